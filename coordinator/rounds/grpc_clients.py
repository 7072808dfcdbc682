"""gRPC implementations of the DraftClient / TargetClient interfaces (see coordinator.rounds.clients).

Each client keeps one bidirectional Rounds stream open and uses it as a synchronous ping-pong:
one request per round, then block for its one reply (~0.7 ms on loopback vs ~1.2 ms for a unary
call). Requests are serialized here rather than by gRPC so that the exact payload sizes can be
counted in the caller's thread: each client's `wire` (a WireCounter) holds the protobuf payload
bytes of its Rounds messages (gRPC adds 5 bytes of framing per message, HTTP/2 a bit more).

Errors are the same types the in-process path raises or catches (coordinator.rounds.errors): a broken
or unreachable worker raises WorkerUnavailable; a worker that raised during the round raises
WorkerInvalidArgument (a ValueError) or WorkerInternalError. Either way the stream is dropped and
the next round opens a new one, so a restarted worker is picked up without a new client.

Worker restarts: a stream that broke while idle (the worker died between rounds) is noticed before
the next round is sent. The target keeps per-request state, so a round that continues requests
raises WorkerUnavailable (their state may be gone); a round of first-round tasks only (each carries
its prompt) is simply sent on a fresh stream. The draft's state only affects proposals, never the
output (the target verifies them), so its client always reopens. Reconnect backoff is capped at
about a second, so a restarted worker is reached within a second of coming back; and if
`resolve_address` is set (a callable returning the worker's current address, e.g. from its Ray
actor after a restart on another node), it is asked after every failure and a changed address
gets a new channel.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import grpc

from coordinator.rounds.errors import (
    WorkerError,
    WorkerGone,
    WorkerInternalError,
    WorkerInvalidArgument,
    WorkerUnavailable,
)
from specdec import wire
from specdec.round_types import DraftInfo, DraftProposal, DraftTask, TargetInfo, VerifyResult, VerifyTask
from specdec.v1 import worker_pb2, worker_pb2_grpc

_UNAVAILABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
_END = object()  # closes a request stream
# Reconnect quickly to a restarted worker (gRPC's default backoff grows to 120 s).
_RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


@dataclass
class WireCounter:
    """Rounds messages exchanged with one worker and their payload bytes, cumulative."""

    rounds: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


def _rounds_path(service: str) -> str:
    return f"/{worker_pb2.DESCRIPTOR.services_by_name[service].full_name}/Rounds"


def _unavailable(worker: str, what: str) -> WorkerUnavailable:
    """`worker` is "target@host:port"; the message names the role first, for users."""
    role = worker.split("@", 1)[0]
    return WorkerUnavailable(f"{role} worker unavailable (restarting?): {worker}: {what}", worker=worker)


def _worker_error(e: grpc.RpcError, worker: str) -> WorkerError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    message = f"{worker}: {code.name}: {details}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return WorkerInvalidArgument(message, worker=worker)
    if code in _UNAVAILABLE_CODES:
        error = _unavailable(worker, f"{code.name}: {details}")
        error.code = code.name
        return error
    return WorkerInternalError(message, worker=worker, code=code.name)


def _request_stream(q: queue.Queue):
    while (item := q.get()) is not _END:
        yield item


class _WorkerClient:
    """Channel, Rounds stream and byte counters shared by the draft and target clients."""

    _service = ""  # "DraftWorker" | "TargetWorker"

    def __init__(self, address: str, name: str, round_timeout: float | None = None):
        self._role = name
        # A worker that does not answer a round in time (a stopped process, a wedged node) is
        # treated as dead: the call is cancelled and the round raises WorkerUnavailable.
        self.round_timeout = round_timeout
        self.on_hang = None  # optional callable(): told when a round timed out (e.g. restart the worker)
        self._lock = threading.Lock()
        self._requests: queue.Queue | None = None
        self._call = None  # the open Rounds call; also the iterator of its replies
        self._closed = False
        self._failed = False  # the last round failed: re-resolve the address before the next one
        self.resolve_address = None  # optional callable -> the worker's current "host:port"
        self._connect(address)
        self.wire = WireCounter()

    def _connect(self, address: str) -> None:
        self.address = address
        self.name = f"{self._role}@{address}"
        self._channel = grpc.insecure_channel(address,
                                              options=list(wire.GRPC_CHANNEL_OPTIONS) + list(_RECONNECT_OPTIONS))
        # Identity (de)serializers: we hand gRPC bytes, see the module docstring.
        self._rounds_method = self._channel.stream_stream(
            _rounds_path(self._service), request_serializer=None, response_deserializer=None
        )
        self._stub = self._make_stub(self._channel)

    def _make_stub(self, channel):
        raise NotImplementedError

    def _maybe_move(self) -> None:
        """After a failure: if the worker now lives elsewhere (restarted on another node), redial.
        Raises WorkerGone when `resolve_address` says it will not come back."""
        if self.resolve_address is None:
            return
        try:
            address = self.resolve_address()
        except WorkerGone:
            raise  # nothing left to wait for (the next round asks again: it may be redeployed)
        except Exception:  # noqa: BLE001 - still restarting: keep the old address
            return
        if address and address != self.address:
            old = self._channel
            self._connect(address)
            old.close()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Block until the channel connects (e.g. while a worker starts); WorkerUnavailable if not."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise WorkerUnavailable(f"{self.name}: not reachable within {timeout_s:.0f}s", worker=self.name) from None

    def _exchange(self, request: bytes, stateless: bool = False) -> bytes:
        """Send one round request on the open stream (opening it if needed); return the reply.

        `stateless`: the round does not rely on state from earlier rounds, so a stream that died
        since the last round (worker restarted?) is replaced silently instead of raising."""
        with self._lock:
            if self._closed:
                raise WorkerUnavailable(f"{self.name}: client is closed", worker=self.name)
            if self._call is not None and self._call.done():
                self._drop_stream()  # broke while idle: the worker may have restarted
                if not stateless:
                    self._failed = True
                    raise _unavailable(self.name, "the connection was lost since the last round; "
                                                  "the requests it was serving are gone")
            if self._failed:
                self._maybe_move()
                self._failed = False
            if self._call is None:
                self._requests = queue.Queue()
                self._call = self._rounds_method(_request_stream(self._requests))
            self._requests.put(request)
            call = self._call
            timer = None
            if self.round_timeout is not None:
                timer = threading.Timer(self.round_timeout, call.cancel)
                timer.daemon = True
                timer.start()
            try:
                reply = next(call)
            except StopIteration:
                self._drop_stream()
                self._failed = True
                raise _unavailable(self.name, "the worker closed the round stream") from None
            except grpc.RpcError as e:
                self._drop_stream()
                if timer is not None and not timer.is_alive() and e.code() == grpc.StatusCode.CANCELLED:
                    self._failed = True
                    if self.on_hang is not None:
                        self.on_hang()
                    raise _unavailable(self.name, f"no answer within {self.round_timeout:g}s "
                                                  "(hung? treated as dead)") from None
                error = _worker_error(e, self.name)
                self._failed = isinstance(error, WorkerUnavailable)
                raise error from None
            finally:
                if timer is not None:
                    timer.cancel()
            self.wire.rounds += 1
            self.wire.bytes_sent += len(request)
            self.wire.bytes_received += len(reply)
            return reply

    def _info(self, timeout_s: float):
        try:
            return self._stub.Info(worker_pb2.InfoRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            raise _worker_error(e, self.name) from None

    def _drop_stream(self) -> None:
        if self._requests is not None:
            self._requests.put(_END)
        if self._call is not None:
            self._call.cancel()
        self._requests, self._call = None, None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop_stream()
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class GrpcDraftClient(_WorkerClient):
    _service = "DraftWorker"

    def __init__(self, address: str, round_timeout: float | None = None):
        super().__init__(address, "draft", round_timeout)

    def _make_stub(self, channel):
        return worker_pb2_grpc.DraftWorkerStub(channel)

    def info(self, timeout_s: float = 30.0) -> DraftInfo:
        return wire.draft_info_from_proto(self._info(timeout_s))

    def propose(self, tasks: list[DraftTask], finished: list[str]) -> list[DraftProposal]:
        request = wire.draft_round_to_proto(tasks, finished).SerializeToString()
        # Always safe to resend: a draft that lost its state proposes worse, never wrongly.
        reply = worker_pb2.DraftRoundReply.FromString(self._exchange(request, stateless=True))
        return wire.draft_reply_from_proto(reply)


class GrpcTargetClient(_WorkerClient):
    _service = "TargetWorker"

    def __init__(self, address: str, round_timeout: float | None = None):
        super().__init__(address, "target", round_timeout)

    def _make_stub(self, channel):
        return worker_pb2_grpc.TargetWorkerStub(channel)

    def info(self, timeout_s: float = 30.0) -> TargetInfo:
        return wire.target_info_from_proto(self._info(timeout_s))

    def verify(self, tasks: list[VerifyTask], finished: list[str]) -> VerifyResult:
        request = wire.verify_round_to_proto(tasks, finished).SerializeToString()
        first_rounds_only = all(t.new_tokens for t in tasks)  # each carries its prompt
        reply = worker_pb2.VerifyRoundReply.FromString(self._exchange(request, stateless=first_rounds_only))
        return wire.verify_reply_from_proto(reply)
