"""specdec: lossless speculative decoding.

`from specdec import LocalEngine, SamplingParams` is the public in-process API. LocalEngine lives
with the coordinator (it is the coordinator with in-process workers) and is imported lazily so
that the library modules stay importable on their own.
"""
from specdec.params import SamplingParams

__all__ = ["LocalEngine", "SamplingParams", "GenerationOutput"]


def __getattr__(name: str):
    if name in ("LocalEngine", "GenerationOutput", "GenerationStats"):
        from coordinator import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
