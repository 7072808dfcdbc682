"""The one door every public request passes, gRPC and HTTP alike: closed while draining, and it
counts the requests inside so that a drain can wait for them.

Both front doors run on the server's event loop, so the gate needs no lock.
"""
from __future__ import annotations

import asyncio


class RequestGate:
    def __init__(self) -> None:
        self.draining = False  # set by GenerationServer.stop: refuse new requests
        self.in_flight = 0
        self._idle: asyncio.Event | None = None  # set whenever in_flight drops to 0

    def enter(self) -> None:
        self.in_flight += 1
        if self._idle is not None:
            self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout: float | None) -> bool:
        """True once no request is in flight; False if some still are after `timeout` seconds."""
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
