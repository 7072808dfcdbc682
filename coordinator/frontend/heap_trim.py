"""Giving the memory of large requests back to the operating system.

glibc's malloc keeps what a thread frees in that thread's arena, and after a large buffer is freed
it raises its mmap threshold so the next ones come from the arenas too: a server that receives
multi-MB requests on several threads (gRPC's pollers, the event loop, the tokenizer thread) ends
up holding tens of MB it no longer uses. After a large request, HeapTrimmer runs malloc_trim(0)
once, off the event loop, which returns free arena pages: `delay_s` after the last large request of
a burst dropped its copies, and at least every `max_wait_s` while large requests keep coming. It is
told by the RequestGate (coordinator.frontend.request_gate) when a request's bytes leave the bytes in flight,
which both transports report once its prompt is tokenized or refused: its buffers are free then,
whenever that is (a trim timed from the request's arrival could run before a slow refusal freed
them, and none would follow). Without glibc (musl, macOS) it does nothing.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util

LARGE_BYTES = 1 << 20  # a request this large is worth a trim after it


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class HeapTrimmer:
    def __init__(self, delay_s: float = 0.2, max_wait_s: float = 1.0):
        self.delay_s, self.max_wait_s = delay_s, max_wait_s
        self._trim = _malloc_trim()
        self._first: float | None = None  # when the first large request since the last trim came
        self._due = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The server's event loop, where `after_request` is called."""
        self._loop = loop

    def after_request(self, size: int) -> None:
        """A request of `size` bytes has dropped its copies; call on the event loop."""
        if size < LARGE_BYTES or self._trim is None or self._loop is None:
            return
        now = self._loop.time()
        self._due = now + self.delay_s
        if self._first is None:
            self._first = now
            self._loop.call_later(self.delay_s, self._run)

    def _run(self) -> None:
        now = self._loop.time()
        if now < self._due and now - self._first < self.max_wait_s:
            self._loop.call_later(self._due - now, self._run)  # the burst goes on: trim after it
            return
        self._first = None
        self._loop.run_in_executor(None, self._trim, 0)
