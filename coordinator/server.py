"""The public gRPC server: specdec.v1.Generation/Generate on top of the Scheduler.

Threads and loops:
- `EngineLoop` owns the Scheduler and calls `step()` in ONE dedicated thread (the scheduler is not
  thread-safe). Submissions and aborts reach it through a thread-safe queue that it drains before
  each round; when there is no work it blocks on that queue instead of spinning. Each round's
  updates go to per-request asyncio queues through `loop.call_soon_threadsafe`.
- `GenerationServer` runs a `grpc.aio` server on an asyncio event loop. One Generate call = one
  request; every round that commits tokens becomes one GenerateResponse, and the last message
  carries finish_reason and stats.

Prompt rule: a non-empty `prompt_token_ids` wins and `prompt` is then ignored (as documented in
generation.proto); otherwise `prompt` is tokenized with the server's tokenizer exactly as
LocalEngine does. Both empty is INVALID_ARGUMENT.

Status codes: a ValueError from validation -> INVALID_ARGUMENT (with its message); a worker that is
gone -> UNAVAILABLE; a deadline -> DEADLINE_EXCEEDED; anything else that broke a round -> INTERNAL.
A client that goes away aborts its request at once, so its KV blocks are freed on the next round.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator.request import Request, RequestStats, RequestUpdate
from coordinator.scheduler import Scheduler
from specdec import wire
from specdec.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name

OnRound = Callable[[Scheduler, list, float], None]


# --- the engine loop -------------------------------------------------------------------------


@dataclass
class EngineCounters:
    """Plain counters, written by the engine thread only (reads from other threads are fine)."""

    rounds: int = 0  # scheduler steps that ran a round (at least one request was running)
    tokens: int = 0  # tokens committed and streamed
    requests_finished: int = 0
    bytes_sent: int = 0  # worker payload bytes (gRPC clients only), cumulative
    bytes_received: int = 0
    last_round_bytes_sent: int = 0
    last_round_bytes_received: int = 0
    last_round_seconds: float = 0.0


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


_STOP = object()


class EngineLoop:
    """Runs the Scheduler in one thread; see the module docstring.

    `scheduler_factory` is called in the engine thread (model loading does not block the event
    loop); requests submitted before it returns wait in the queue. `on_round(scheduler, updates,
    round_seconds)` is called in the engine thread after each round that ran (metrics hook);
    an exception in it is logged and ignored.
    """

    def __init__(self, scheduler_factory: Callable[[], Scheduler], on_round: OnRound | None = None):
        self._factory = scheduler_factory
        self.on_round = on_round
        self.scheduler: Scheduler | None = None
        self.counters = EngineCounters()
        self.ready = threading.Event()  # set once the scheduler exists (or failed to be made)
        self.start_error: BaseException | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)

    # -- called from any thread ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request, sink: _Sink) -> None:
        """Queue a request. Its sink receives RequestUpdates, or one ValueError if it is invalid."""
        self._inbox.put(("add", request, sink))

    def abort(self, req_id: str) -> None:
        self._inbox.put(("abort", req_id))

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread: requests still queued or running end with UNAVAILABLE."""
        if self._thread.is_alive():
            self._inbox.put((_STOP,))
            self._thread.join(timeout)

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and self.start_error is None

    @property
    def num_active(self) -> int:
        return len(self._sinks)

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.scheduler = self._factory()
        except BaseException as e:  # noqa: BLE001 - reported to every request and to health
            log.exception("the engine failed to start")
            self.start_error = e
            self.ready.set()
            self._serve_failed(f"the engine failed to start: {type(e).__name__}: {e}")
            return
        self.ready.set()
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - never leave a client waiting for an answer
            log.exception("the engine loop crashed")
            message = f"the engine loop crashed: {type(e).__name__}: {e}"
            self._fail_everyone(message, "internal")
            self._serve_failed(message)

    def _loop(self) -> None:
        sched = self.scheduler
        while True:
            # Block when idle; otherwise take whatever arrived since the last round. The wait is
            # bounded: releases that failed (worker restarting) become due again later on their own.
            block = not sched.has_work()
            while True:
                try:
                    command = self._inbox.get(block=block, timeout=1.0 if block else None)
                except queue.Empty:
                    break
                block = False
                if command[0] is _STOP:
                    self._shutdown()
                    return
                self._handle(command)
            if not sched.has_work():
                continue
            rounds_before = sched.total_rounds
            t0 = time.perf_counter()
            try:
                updates = sched.step()
            except Exception as e:  # noqa: BLE001 - a bug in a round fails its requests, not the server
                log.exception("a scheduler round raised")
                for req_id in list(self._sinks):
                    with contextlib.suppress(Exception):
                        sched.abort(req_id)
                self._fail_everyone(f"{type(e).__name__}: {e}", "internal")
                continue
            seconds = time.perf_counter() - t0
            self._route(updates)
            if sched.total_rounds > rounds_before:
                self._count(updates, seconds)
            if self.on_round is not None:
                try:
                    self.on_round(sched, updates, seconds)
                except Exception:  # noqa: BLE001 - metrics must never break serving
                    log.exception("on_round hook failed")

    def _handle(self, command) -> None:
        if command[0] == "add":
            _, request, sink = command
            try:
                self.scheduler.add_request(request)
            except ValueError as e:
                sink.put(e)
                return
            except Exception as e:  # noqa: BLE001
                log.exception("add_request raised")
                sink.put(RequestUpdate(req_id=request.req_id, token_ids=[], text="", finished=True,
                                       finish_reason="error", error=f"{type(e).__name__}: {e}", error_kind="internal"))
                return
            self._sinks[request.req_id] = sink
        elif command[0] == "abort":
            if self._sinks.pop(command[1], None) is not None:
                self.scheduler.abort(command[1])

    def _route(self, updates: list[RequestUpdate]) -> None:
        for update in updates:
            sink = self._sinks.get(update.req_id)
            if sink is None:
                continue
            if update.finished:
                del self._sinks[update.req_id]
                self.counters.requests_finished += 1
            sink.put(update)

    def _count(self, updates: list[RequestUpdate], seconds: float) -> None:
        c = self.counters
        c.rounds += 1
        c.tokens += sum(len(u.token_ids) for u in updates)
        c.last_round_seconds = seconds
        sent = received = 0
        for client in (self.scheduler.target, self.scheduler.draft):
            # Cumulative counters give exact per-round deltas even when a client sat a round out.
            if client is not None and hasattr(client, "bytes_sent"):
                sent += client.bytes_sent
                received += client.bytes_received
            elif client is not None and hasattr(client, "last_round_bytes_sent"):
                sent += c.bytes_sent + client.last_round_bytes_sent
                received += c.bytes_received + client.last_round_bytes_received
        c.last_round_bytes_sent, c.last_round_bytes_received = sent - c.bytes_sent, received - c.bytes_received
        c.bytes_sent, c.bytes_received = sent, received

    def _shutdown(self) -> None:
        for req_id in list(self._sinks):
            self.scheduler.abort(req_id)
        self._fail_everyone("the server is shutting down", "unavailable")
        self._fail_queued("the server is shutting down")
        with contextlib.suppress(Exception):
            self.scheduler.step()  # frees the workers' caches of what was aborted

    def _fail_everyone(self, message: str, kind: str) -> None:
        for req_id, sink in list(self._sinks.items()):
            sink.put(RequestUpdate(req_id=req_id, token_ids=[], text="", finished=True, finish_reason="error",
                                   error=message, error_kind=kind))
        self._sinks.clear()

    def _serve_failed(self, message: str) -> None:
        """No scheduler: answer every submission with UNAVAILABLE until stopped."""
        while (command := self._inbox.get())[0] is not _STOP:
            if command[0] == "add":
                command[2].put(RequestUpdate(req_id=command[1].req_id, token_ids=[], text="", finished=True,
                                             finish_reason="error", error=message, error_kind="unavailable"))

    def _fail_queued(self, message: str) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request, sink = command
                sink.put(RequestUpdate(req_id=request.req_id, token_ids=[], text="", finished=True,
                                       finish_reason="error", error=message, error_kind="unavailable"))


# --- gRPC service ----------------------------------------------------------------------------


def stats_to_proto(stats: RequestStats | None) -> generation_pb2.GenerationStats:
    msg = generation_pb2.GenerationStats()
    if stats is None:
        return msg
    if stats.acceptance_rate is not None:
        msg.acceptance_rate = stats.acceptance_rate
    msg.mean_accepted_length = stats.mean_accepted_length
    msg.rounds = stats.rounds
    msg.target_forward_passes = stats.target_forward_passes
    msg.draft_forward_passes = stats.draft_forward_passes
    msg.prompt_tokens = stats.prompt_tokens
    msg.generated_tokens = stats.generated
    return msg


def _error_status(update: RequestUpdate) -> tuple[grpc.StatusCode, str]:
    kind, error = update.error_kind, update.error or "request failed"
    if kind == "unavailable":
        return grpc.StatusCode.UNAVAILABLE, f"the service is unavailable: {error}; retry later"
    if kind == "deadline":
        return grpc.StatusCode.DEADLINE_EXCEEDED, error
    return grpc.StatusCode.INTERNAL, f"the request failed inside the service: {error}"


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: EngineLoop, tokenizer):
        self.engine = engine
        self.tokenizer = tokenizer
        self.draining = False
        self.in_flight = 0
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._idle: asyncio.Event | None = None  # set whenever in_flight drops to 0

    def encode(self, request: generation_pb2.GenerateRequest) -> list[int]:
        if request.prompt_token_ids:
            return list(request.prompt_token_ids)
        if not request.prompt:
            raise ValueError("the prompt is empty: set prompt or prompt_token_ids")
        if self.tokenizer is None:
            raise ValueError("this server has no tokenizer: send the prompt as prompt_token_ids")
        ids = list(self.tokenizer(request.prompt)["input_ids"])
        if not ids:
            raise ValueError("the prompt tokenizes to no tokens")
        return ids

    async def Generate(self, request, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")
        if self.engine.ready.is_set() and self.engine.start_error is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine failed to start: {self.engine.start_error}")
        try:
            params, k = wire.params_from_generate_request(request)
            prompt_ids = self.encode(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        req = Request(req_id=f"{self._prefix}-{next(self._ids)}", prompt_ids=prompt_ids, params=params,
                      num_speculative_tokens=k, deadline=deadline)
        updates: asyncio.Queue = asyncio.Queue()
        done = False

        def on_done(_ctx) -> None:  # the RPC ended, however it ended: drop the request if it still runs
            if not done:
                self.engine.abort(req.req_id)

        context.add_done_callback(on_done)
        self._enter()
        try:
            self.engine.submit(req, _Sink(asyncio.get_running_loop(), updates))
            while True:
                item = await updates.get()
                if isinstance(item, ValueError):
                    done = True
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(item))
                update: RequestUpdate = item
                if update.error_kind or (update.finished and update.error):
                    done = True
                    await context.abort(*_error_status(update))
                response = generation_pb2.GenerateResponse(token_ids=update.token_ids, text=update.text)
                if update.finished:
                    done = True
                    response.finish_reason = update.finish_reason or ""
                    response.stats.CopyFrom(stats_to_proto(update.stats))
                    yield response
                    return
                if update.token_ids or update.text:
                    yield response
        finally:
            if not done:  # cancelled (client gone, deadline, server stop): free its blocks now
                done = True
                self.engine.abort(req.req_id)
            self._leave()

    def _enter(self) -> None:
        self.in_flight += 1
        if self._idle is not None:
            self._idle.clear()

    def _leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout: float | None) -> bool:
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class _BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every call except health checks."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}"

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(f"/{HEALTH_SERVICE_NAME}/"):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if metadata.get("authorization") == self._expected:
            return handler
        message = "missing or wrong bearer token (send 'authorization: Bearer <token>' metadata)"

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - makes this an async generator

        ser, de = handler.response_serializer, handler.request_deserializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(deny, de, ser)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny_stream, de, ser)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(deny, de, ser)
        return grpc.stream_stream_rpc_method_handler(deny_stream, de, ser)


# --- the server ------------------------------------------------------------------------------


class GenerationServer:
    """The public service: Generate + grpc.health.v1 + server reflection.

    Health is NOT_SERVING until the scheduler is built, SERVING after, NOT_SERVING while draining.
    Optional TLS (PEM paths) and an optional bearer token checked on every call but health.
    """

    def __init__(self, scheduler_factory: Callable[[], Scheduler], tokenizer, address: str = "0.0.0.0:50051",
                 max_concurrent_rpcs: int | None = None, on_round: OnRound | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, auth_token: str | None = None):
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both a certificate and a key")
        self.address = address
        self.engine = EngineLoop(scheduler_factory, on_round)
        self.servicer: GenerationServicer | None = None
        self.tokenizer = tokenizer
        self.port: int | None = None
        self._max_concurrent_rpcs = max_concurrent_rpcs
        self._tls = (tls_cert, tls_key) if tls_cert else None
        self._auth_token = auth_token
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._watch: asyncio.Task | None = None
        self._stopped: asyncio.Event | None = None

    @property
    def scheduler(self) -> Scheduler | None:
        return self.engine.scheduler

    async def start(self) -> int:
        """Bind, start serving (health NOT_SERVING until the engine is ready); return the port."""
        interceptors = [_BearerTokenInterceptor(self._auth_token)] if self._auth_token else []
        # No SO_REUSEPORT: a second server on a busy port must fail, not silently share it.
        options = list(wire.GRPC_SERVER_OPTIONS)
        server = grpc.aio.server(options=options, interceptors=interceptors,
                                 maximum_concurrent_rpcs=self._max_concurrent_rpcs)
        self.servicer = GenerationServicer(self.engine, self.tokenizer)
        generation_pb2_grpc.add_GenerationServicer_to_server(self.servicer, server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
        try:
            if self._tls:
                cert, key = (open(p, "rb").read() for p in self._tls)
                port = server.add_secure_port(self.address, grpc.ssl_server_credentials([(key, cert)]))
            else:
                port = server.add_insecure_port(self.address)
        except RuntimeError as e:
            raise RuntimeError(f"could not bind {self.address}: {e}") from e
        if port == 0:
            raise RuntimeError(f"could not bind {self.address}")
        self._server, self.port = server, port
        self._stopped = asyncio.Event()
        await server.start()
        self.engine.start()
        self._watch = asyncio.create_task(self._mark_ready())
        log.info("specdec Generation serving on %s (port %d)", self.address, port)
        return port

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    async def _mark_ready(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.ready.wait)
        if self.engine.is_ready and not self.servicer.draining:
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the scheduler is built; re-raises its construction error."""
        ok = await asyncio.get_running_loop().run_in_executor(None, self.engine.ready.wait, timeout)
        if not ok:
            raise TimeoutError(f"the engine was not ready within {timeout}s")
        if self.engine.start_error is not None:
            raise RuntimeError(f"the engine failed to start: {self.engine.start_error}") from self.engine.start_error
        if self._watch is not None:
            await self._watch  # health says SERVING once this returns

    async def stop(self, grace_s: float | None = 10.0) -> None:
        """Drain: refuse new calls (UNAVAILABLE), let in-flight ones finish for up to grace_s
        seconds (None: wait for them however long), cancel the rest, then stop the engine."""
        if self._server is None or self.servicer.draining:
            if self._stopped is not None:
                await self._stopped.wait()
            return
        self.servicer.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        finished = await self.servicer.wait_idle(grace_s)
        if not finished:
            log.warning("%d requests still running after %ss of grace: cancelling them", self.servicer.in_flight, grace_s)
        await self._server.stop(0.5)
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop, 30.0)
        if self._watch is not None:
            self._watch.cancel()
        self._stopped.set()

    async def serve_forever(self, grace_s: float | None = 10.0) -> None:
        """Start, then serve until SIGINT/SIGTERM (graceful stop with grace_s) or until stopped."""
        import signal

        if self._server is None:
            await self.start()
        loop = asyncio.get_running_loop()
        stopping: list[asyncio.Task] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
                loop.add_signal_handler(sig, lambda: stopping or stopping.append(asyncio.create_task(self.stop(grace_s))))
        await self.wait()
        if stopping:
            await stopping[0]

    async def wait(self) -> None:
        """Block until the server has stopped."""
        await self._server.wait_for_termination()
        if self._stopped is not None and self.servicer.draining:
            await self._stopped.wait()


# --- running a server on its own thread (tests, CLI) ----------------------------------------


class ServerThread:
    """A GenerationServer on its own event loop thread; use `run_server_in_thread`."""

    def __init__(self, server: GenerationServer):
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="specdec-grpc", daemon=True)
        self.port: int | None = None

    def call(self, coro, timeout: float | None = None):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self, wait_ready: bool = True, timeout: float = 120.0) -> int:
        self._thread.start()
        try:
            self.port = self.call(self.server.start(), timeout)
            if wait_ready:
                self.call(self.server.wait_ready(timeout), timeout + 5)
        except BaseException:
            self.stop(grace_s=0)
            raise
        return self.port

    def stop(self, grace_s: float | None = 5.0) -> None:
        if not self._thread.is_alive():
            return
        try:
            if self.server._server is not None:
                self.call(self.server.stop(grace_s))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self.loop.close()

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def run_server_in_thread(scheduler_factory: Callable[[], Scheduler], tokenizer, address: str = "127.0.0.1:0",
                         grace_s: float | None = 5.0, wait_ready: bool = True, **kwargs) -> Iterator[ServerThread]:
    """Start a GenerationServer on its own event-loop thread; yields the ServerThread (`.port`,
    `.server`, `.call(coro)`); stops it (with grace_s) on exit. kwargs go to GenerationServer."""
    handle = ServerThread(GenerationServer(scheduler_factory, tokenizer, address=address, **kwargs))
    handle.start(wait_ready=wait_ready)
    try:
        yield handle
    finally:
        handle.stop(grace_s)

