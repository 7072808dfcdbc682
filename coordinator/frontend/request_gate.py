"""The one door every public request passes, gRPC and HTTP alike: closed while draining, it counts
the requests inside so that a drain can wait for them, and it bounds the requests *waiting* and
the request bytes *in flight*.

A request waits from the moment it is let in (before its body is read) until its first update
arrives from the scheduler (it has been prefilled) or it ends. At most `max_waiting` requests wait
at once; one more is refused with QueueFull (gRPC RESOURCE_EXHAUSTED, HTTP 429), so a flood of
requests costs memory and tokenizer time in proportion to that bound, not to the flood. The count
is the servers' own, so it holds however many schedulers stand behind them.

A request's bytes are in flight from just before its body is read until its prompt is tokenized
or refused: its copies (the transport's buffers, the decoded message, the prompt's text) live
then, and are dropped at the end. Before the body is read its size is not known (gRPC hands the
message over whole), so a request takes room for what reading it may buffer (max_request_bytes,
or an HTTP body's Content-Length) and gives back the difference once it is read. Past
`max_bytes_in_flight` requests wait in turn, up to `bytes_wait_s`, unread (a gRPC stream then
holds at most its HTTP/2 flow-control window, an HTTP connection uvicorn's read-ahead), and then
are refused with QueueFull naming --max-request-bytes-in-flight. So however many clients send
large requests, the servers hold at most `max_bytes_in_flight` of them, each in a few copies.

Both front doors run on the server's event loop, so the gate needs no lock.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

BYTES_WAIT_S = 1.0  # how long a request waits for room among the bytes in flight before it is refused


class QueueFull(Exception):
    """No waiting slot is free, or no room among the request bytes in flight; the message names
    the limit and its flag."""


class WaitingSlot:
    """One request's place among the waiting; `release()` it once (more calls are no-ops)."""

    def __init__(self, gate: RequestGate):
        self._gate: RequestGate | None = gate

    def release(self) -> None:
        if self._gate is not None:
            self._gate.waiting -= 1
            self._gate = None


class RequestBytes:
    """One request's room among the request bytes in flight: `shrink(size)` it to the request's
    size once read, `release()` it once its copies are dropped (more calls are no-ops)."""

    def __init__(self, gate: RequestGate, size: int):
        self._gate: RequestGate | None = gate
        self.size = size

    def shrink(self, size: int) -> None:
        if self._gate is not None and size < self.size:
            self._gate.give_back_bytes(self.size - size)
            self.size = size

    def release(self) -> None:
        if self._gate is not None:
            gate, self._gate = self._gate, None
            gate.give_back_bytes(self.size)
            if gate.on_bytes_freed is not None:
                gate.on_bytes_freed(self.size)


class RequestGate:
    def __init__(self, max_waiting: int | None = None, max_bytes_in_flight: int | None = None,
                 on_bytes_freed: Callable[[int], None] | None = None) -> None:
        """`on_bytes_freed(size)`: told when a request of `size` bytes has dropped its copies
        (coordinator.frontend.heap_trim gives large ones back to the operating system)."""
        self.draining = False  # set by GenerationServer.stop: refuse new requests
        self.in_flight = 0
        self.max_waiting = max_waiting  # None: no bound
        self.waiting = 0
        self.max_bytes_in_flight = max_bytes_in_flight  # None: no bound
        self.bytes_in_flight = 0
        self.bytes_wait_s = BYTES_WAIT_S
        self.on_bytes_freed = on_bytes_freed
        self._bytes_queue: deque[tuple[int, asyncio.Future]] = deque()  # requests waiting for room, in turn
        self._idle: asyncio.Event | None = None  # set whenever in_flight drops to 0

    def wait_slot(self) -> WaitingSlot:
        """A waiting slot for a new request; QueueFull if all `max_waiting` are taken."""
        if self.max_waiting is not None and self.waiting >= self.max_waiting:
            raise QueueFull(f"the server is overloaded: {self.waiting} requests are already waiting to start "
                            f"(the server's --max-waiting-requests is {self.max_waiting}); retry later")
        self.waiting += 1
        return WaitingSlot(self)

    @property
    def waiting_for_bytes(self) -> int:
        return len(self._bytes_queue)

    async def take_bytes(self, size: int) -> RequestBytes:
        """Room for a request of up to `size` bytes, in turn behind the requests already waiting;
        QueueFull if there is none within `bytes_wait_s`."""
        bound = self.max_bytes_in_flight
        if bound is None or (not self._bytes_queue and self.bytes_in_flight + size <= bound):
            self.bytes_in_flight += size
            return RequestBytes(self, size)
        turn = (size, asyncio.get_running_loop().create_future())
        self._bytes_queue.append(turn)
        try:
            await asyncio.wait_for(asyncio.shield(turn[1]), self.bytes_wait_s)
        except BaseException as e:  # timed out, or the call was cancelled
            if turn[1].done():
                self.give_back_bytes(size)  # room came as it gave up
            else:
                turn[1].cancel()
                self._bytes_queue.remove(turn)
                self._let_in()  # the requests behind it may fit
            if isinstance(e, asyncio.TimeoutError):
                raise QueueFull(f"the server is overloaded: {self.bytes_in_flight} bytes of requests are being "
                                f"read or tokenized (the server's --max-request-bytes-in-flight is {bound}); "
                                f"retry later") from None
            raise
        return RequestBytes(self, size)

    def give_back_bytes(self, size: int) -> None:
        """Called by RequestBytes."""
        self.bytes_in_flight -= size
        self._let_in()

    def _let_in(self) -> None:
        """Give room to the waiting requests at the front of the queue that now fit."""
        while self._bytes_queue and self.bytes_in_flight + self._bytes_queue[0][0] <= self.max_bytes_in_flight:
            size, room = self._bytes_queue.popleft()
            self.bytes_in_flight += size
            room.set_result(None)

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
