"""Errors a worker client raises, the same for the in-process and the gRPC transport.

The coordinator needs to tell apart "the request was bad" (fail that request, INVALID_ARGUMENT),
"the worker broke on it" (INTERNAL) and "the worker is gone" (end every in-flight request with
UNAVAILABLE and wait for it to come back). The first two subclass ValueError / RuntimeError so
code written against in-process workers, which raise those directly, also catches them here.
"""
from __future__ import annotations


class WorkerError(Exception):
    """A worker call failed. `code` is the gRPC status code name, e.g. "INTERNAL"."""

    code = "UNKNOWN"

    def __init__(self, message: str, *, worker: str = "", code: str | None = None) -> None:
        super().__init__(message)
        self.worker = worker  # e.g. "draft@127.0.0.1:50051", for log lines
        if code is not None:
            self.code = code


class WorkerInvalidArgument(WorkerError, ValueError):
    """The worker rejected the round's input; the worker itself is fine."""

    code = "INVALID_ARGUMENT"


class WorkerInternalError(WorkerError, RuntimeError):
    """The worker raised while running the round; it is still serving."""

    code = "INTERNAL"


class WorkerUnavailable(WorkerError):
    """The worker cannot be reached or its stream broke; in-flight requests end with UNAVAILABLE."""

    code = "UNAVAILABLE"


class WorkerGone(WorkerUnavailable):
    """The worker will not come back by itself (e.g. Ray has no restarts left for its actor):
    its requests fail now instead of waiting out the recovery timeout."""
