"""The one door every public request passes, gRPC and HTTP alike: closed while draining, it counts
the requests inside so that a drain can wait for them, and it bounds the requests *waiting*.

A request waits from the moment it is let in (before its prompt is tokenized) until its first
update arrives from the scheduler (it has been prefilled) or it ends. At most
`max_waiting` requests wait at once; one more is refused with QueueFull (gRPC RESOURCE_EXHAUSTED,
HTTP 429), so a flood of requests costs memory and tokenizer time in proportion to that bound,
not to the flood. The count is the servers' own, so it holds however many schedulers stand
behind them.

Both front doors run on the server's event loop, so the gate needs no lock.
"""
from __future__ import annotations

import asyncio


class QueueFull(Exception):
    """No waiting slot is free; the message names the limit and its flag."""


class WaitingSlot:
    """One request's place among the waiting; `release()` it once (more calls are no-ops)."""

    def __init__(self, gate: RequestGate):
        self._gate: RequestGate | None = gate

    def release(self) -> None:
        if self._gate is not None:
            self._gate.waiting -= 1
            self._gate = None


class RequestGate:
    def __init__(self, max_waiting: int | None = None) -> None:
        self.draining = False  # set by GenerationServer.stop: refuse new requests
        self.in_flight = 0
        self.max_waiting = max_waiting  # None: no bound
        self.waiting = 0
        self._idle: asyncio.Event | None = None  # set whenever in_flight drops to 0

    def wait_slot(self) -> WaitingSlot:
        """A waiting slot for a new request; QueueFull if all `max_waiting` are taken."""
        if self.max_waiting is not None and self.waiting >= self.max_waiting:
            raise QueueFull(f"the server is overloaded: {self.waiting} requests are already waiting to start "
                            f"(the server's --max-waiting-requests is {self.max_waiting}); retry later")
        self.waiting += 1
        return WaitingSlot(self)

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
