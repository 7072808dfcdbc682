"""specdec: lossless speculative decoding.

`from specdec import LocalEngine, SamplingParams` is the public in-process API. This file is the
facade: it re-exports what the composition layer (the specdec_app package) assembles, loading it
only when one of those names is first used, so that importing the library layer (specdec.sampling,
specdec.model, specdec.params, ...) loads neither the coordinator nor grpc, Ray or fastapi. The rest
of `specdec/` is the library layer and never imports the coordinator, the workers or specdec_app.
"""
from __future__ import annotations

from specdec.config import ServiceConfig
from specdec.params import SamplingParams

__all__ = ["GenerationOutput", "GenerationStats", "LocalEngine", "SamplingParams", "ServiceConfig"]


def __getattr__(name: str):
    if name not in ("GenerationOutput", "GenerationStats", "LocalEngine"):
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    # The composition layer, loaded on first use: importing it here, with the package, would load
    # the coordinator, grpc and the rest with every `import specdec.<library module>`.
    from specdec_app import engine

    value = globals()[name] = getattr(engine, name)  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
