"""A GenerationServer on its own event-loop thread (the CLI, the Ray coordinator actor, tests)."""
from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator

from coordinator.frontend.server import GenerationServer
from coordinator.replicas.scheduler_thread import OnRound
from coordinator.rounds.scheduler import Scheduler
from specdec.config import ServerConfig


class ServerThread:
    def __init__(self, server: GenerationServer):
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="specdec-grpc", daemon=True)
        self.port: int | None = None

    @property
    def http_port(self) -> int | None:
        """The HTTP API's bound port once started (None: off)."""
        return self.server.http_port

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

    def stop(self, grace_s: float | None = None) -> None:
        """Drain for grace_s seconds (default: the server config's grace_period), then stop."""
        if not self._thread.is_alive():
            return
        try:
            if self.server.port is not None:
                self.call(self.server.stop(grace_s))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self.loop.close()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# What tests and the load test serve on unless told otherwise: loopback, any free ports.
LOOPBACK_SERVER = ServerConfig(host="127.0.0.1", port=0, http_port=-1, grace_period=5.0)


@contextlib.contextmanager
def run_server_in_thread(scheduler_factory: Callable[[], Scheduler], tokenizer,
                         config: ServerConfig = LOOPBACK_SERVER, on_round: OnRound | None = None,
                         wait_ready: bool = True) -> Iterator[ServerThread]:
    """Start a GenerationServer on its own event-loop thread; yields the ServerThread (`.port`,
    `.http_port`, `.server`, `.call(coro)`); stops it (draining for config.grace_period) on exit."""
    handle = ServerThread(GenerationServer(scheduler_factory, tokenizer, config, on_round))
    handle.start(wait_ready=wait_ready)
    try:
        yield handle
    finally:
        handle.stop()
