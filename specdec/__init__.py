"""specdec: lossless speculative decoding.

`from specdec import LocalEngine, SamplingParams` is the public in-process API. This file is the
facade: it re-exports what the composition layer (specdec.app) assembles. The rest of `specdec/`
is the library layer and never imports the coordinator or the workers.
"""
from specdec.app.engine import GenerationOutput, GenerationStats, LocalEngine
from specdec.config import ServiceConfig
from specdec.params import SamplingParams

__all__ = ["GenerationOutput", "GenerationStats", "LocalEngine", "SamplingParams", "ServiceConfig"]
