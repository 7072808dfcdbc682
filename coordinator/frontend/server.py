"""The public servers' lifecycle: bind, serve, report health, drain, stop.

It serves Generate (coordinator.frontend.servicer), grpc.health.v1 and server reflection on one grpc.aio
server and, unless ServerConfig.http_port is 0, the OpenAI-compatible HTTP API (coordinator.frontend.http_api)
with uvicorn on the same event loop (coordinator.frontend.http_server); both feed one Router (one
SchedulerThread per target replica, coordinator.replicas.router) and pass one RequestGate (which bounds the
requests waiting to start and the request bytes in flight) and tokenize on one TokenizerPool
thread; a request larger than ServerConfig.max_request_bytes is refused by either transport before
it is read whole. Health is NOT_SERVING (HTTP /health: 503) until the schedulers are built,
SERVING after, NOT_SERVING while no replica can serve (their target workers given up on) and while
draining. Optional TLS (PEM paths) and an optional bearer token checked on every call but health,
on both ports (ServerConfig). The server's Prometheus registry (coordinator.telemetry.prometheus_metrics) is
fed by every round and every request.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator.frontend.auth import HEALTH_SERVICE_NAME, BearerTokenInterceptor
from coordinator.frontend.heap_trim import HeapTrimmer
from coordinator.frontend.http_api import HttpApi
from coordinator.frontend.http_server import HttpServer
from coordinator.frontend.request_decoding import add_generation_servicer
from coordinator.frontend.request_gate import RequestGate
from coordinator.frontend.request_limits import RequestLimits
from coordinator.frontend.servicer import GenerationServicer
from coordinator.frontend.tokenizer_pool import TokenizerPool
from coordinator.replicas.router import ReplicaLauncher, Router, SchedulerFactory
from coordinator.replicas.scheduler_thread import OnRound
from coordinator.rounds.scheduler import Scheduler
from coordinator.telemetry.prometheus_metrics import PrometheusMetrics
from specdec import wire
from specdec.config import ReplicaConfig, ServerConfig
from specdec.v1 import generation_pb2

log = logging.getLogger(__name__)

HEALTH_POLL_S = 0.25  # how soon health follows the scheduler's state
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationServer:
    def __init__(self, scheduler_factory: Callable[[], Scheduler] | list[SchedulerFactory], tokenizer,
                 config: ServerConfig, on_round: OnRound | None = None, launcher: ReplicaLauncher | None = None,
                 replica_config: ReplicaConfig | None = None):
        """One scheduler factory per target replica (a single one: one replica); `launcher` and
        `replica_config` turn on autoscaling (coordinator.replicas.router)."""
        self.config = config
        self.metrics = PrometheusMetrics()
        self.heap = HeapTrimmer()
        self.gate = RequestGate(config.max_waiting_requests, config.max_request_bytes_in_flight,
                                on_bytes_freed=self.heap.after_request)
        self.limits = RequestLimits.from_config(config)
        factories = scheduler_factory if isinstance(scheduler_factory, list) else [scheduler_factory]
        self.scheduler = Router(factories, on_round, record_round=self.metrics.on_round, launcher=launcher,
                                replica_config=replica_config)
        self.servicer: GenerationServicer | None = None
        self.tokenizer = tokenizer  # the servers' own: used on the tokenizer pool's thread only
        self.tokenizers: TokenizerPool | None = None
        self.port: int | None = None
        self.http_port: int | None = None  # None: the HTTP API is off
        self._http: HttpServer | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._watch: asyncio.Task | None = None
        self._follow: asyncio.Task | None = None
        self._stopped: asyncio.Event | None = None

    async def start(self) -> int:
        """Bind, start serving (health NOT_SERVING until the scheduler is ready); return the gRPC
        port (`http_port` holds the HTTP one)."""
        config = self.config
        interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
        options = [o for o in wire.GRPC_SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
        options.append(("grpc.max_receive_message_length", config.max_request_bytes))
        # What gRPC's core may buffer for requests beyond the bytes in flight (RequestGate). No BDP
        # probing: it widens the HTTP/2 flow-control windows until a stream whose message nobody
        # reads yet (its request waits for room) is buffered whole; at the default 64 KiB window a
        # waiting one costs almost nothing. Requests are small next to the streamed answers, which
        # the client's window governs. And reads of at most 64 KiB: after a large message a
        # connection otherwise keeps a read buffer of ~1 MB for as long as it stays open
        # (measured: 30 idle connections that had each sent one 3 MB request held 36-47 MB).
        options += [("grpc.http2.bdp_probe", 0), ("grpc.experimental.tcp_max_read_buffer_size", 64 << 10)]
        server = grpc.aio.server(options=options, interceptors=interceptors,
                                 maximum_concurrent_rpcs=config.max_concurrent_rpcs)
        self.tokenizers = TokenizerPool(self.tokenizer)
        self.servicer = GenerationServicer(self.scheduler, self.tokenizers, self.limits, self.gate, self.metrics)
        self.heap.bind(asyncio.get_running_loop())
        add_generation_servicer(self.servicer, server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
        try:
            if config.tls_cert:
                cert, key = Path(config.tls_cert).read_bytes(), Path(config.tls_key).read_bytes()
                port = server.add_secure_port(config.address, grpc.ssl_server_credentials([(key, cert)]))
            else:
                port = server.add_insecure_port(config.address)
        except RuntimeError as e:
            raise RuntimeError(f"could not bind {config.address}: {e}") from e
        if port == 0:
            raise RuntimeError(f"could not bind {config.address}")
        if config.http_enabled:
            api = HttpApi(self.scheduler, self.tokenizers, self.limits, self.gate, self.metrics, config.auth_token,
                          warnings=config.exposure_warnings())
            http = HttpServer(api.app, config.host, config.http_port, config.tls_cert, config.tls_key)
            try:
                self.http_port = await http.start()
            except BaseException:
                await server.stop(None)
                raise
            self._http = http
        self._server, self.port = server, port
        self._stopped = asyncio.Event()
        await server.start()
        self.scheduler.start()
        self._watch = asyncio.create_task(self._mark_ready())
        self._follow = asyncio.create_task(self._follow_health())
        log.info("specdec Generation serving on %s (port %d)%s", config.address, port,
                 f", HTTP API on port {self.http_port}" if self._http else "")
        for warning in config.exposure_warnings():
            log.warning("UNSAFE: %s", warning)
        return port

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    async def _mark_ready(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.scheduler.ready.wait)
        if self.scheduler.is_ready and not self.gate.draining:
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    async def _follow_health(self) -> None:
        """After start-up: NOT_SERVING while the scheduler cannot serve (target worker given up
        on, loop crashed), SERVING again once it can; polled, as that state changes on the
        scheduler's thread."""
        serving = True
        while not self.gate.draining:
            await asyncio.sleep(HEALTH_POLL_S)
            failure = self.scheduler.failure
            if (failure is None) != serving and not self.gate.draining:
                serving = failure is None
                if serving:
                    log.warning("serving again")
                else:
                    log.error("not serving: %s", failure)
                await self._set_health(health_pb2.HealthCheckResponse.SERVING if serving
                                       else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the scheduler is built; re-raises its construction error."""
        ok = await asyncio.get_running_loop().run_in_executor(None, self.scheduler.ready.wait, timeout)
        if not ok:
            raise TimeoutError(f"the engine was not ready within {timeout}s")
        if self.scheduler.start_error is not None:
            raise RuntimeError(f"the engine failed to start: {self.scheduler.start_error}") \
                from self.scheduler.start_error
        if self._watch is not None:
            await self._watch  # health says SERVING once this returns

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: refuse new calls (gRPC UNAVAILABLE, HTTP 503), let in-flight ones on both ports
        finish for up to grace_s seconds (default: the config's grace_period), cancel the rest,
        then stop the scheduler."""
        if self._server is None or self.gate.draining:
            if self._stopped is not None:
                await self._stopped.wait()
            return
        grace_s = self.config.grace_period if grace_s is None else grace_s
        self.gate.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if not await self.gate.wait_idle(grace_s):
            log.warning("%d requests still running after %ss of grace: cancelling them", self.gate.in_flight, grace_s)
        await asyncio.gather(self._server.stop(0.5), *([self._http.stop()] if self._http else []))
        await asyncio.get_running_loop().run_in_executor(None, self.scheduler.stop, 30.0)
        self.tokenizers.close()
        for task in (self._watch, self._follow):
            if task is not None:
                task.cancel()
        self._stopped.set()
