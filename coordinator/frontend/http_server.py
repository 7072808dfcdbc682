"""uvicorn serving an ASGI app on the caller's event loop, started and stopped by GenerationServer.

It runs as a task on the gRPC server's loop rather than on a thread of its own: both front doors
then tokenize on one thread (Hugging Face fast tokenizers are not thread-safe), share the drain
state (coordinator.frontend.request_gate) without locks, and receive their updates through the same
SchedulerThread sinks. The socket is bound here, not by uvicorn, so that a port in use is an
exception for the caller (uvicorn would call sys.exit) and port -1 can mean "any free port".
"""
from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn

from specdec.addresses import host_port

# Seconds uvicorn lets responses still running at stop finish before cancelling them; the drain
# before it (GenerationServer.stop) already gave them the grace period.
SHUTDOWN_TIMEOUT_S = 1.0


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (-1: any free port); OSError names the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host.strip("[]"), max(port, 0)), family=family, backlog=2048)
    except OSError as e:
        raise OSError(e.errno, f"could not bind the HTTP API on {host_port(host, port)}: {e.strerror}") from None


class HttpServer:
    def __init__(self, app, host: str, port: int, tls_cert: str | None = None, tls_key: str | None = None):
        self.host, self.requested_port = host, port
        self.port: int | None = None
        self._config = uvicorn.Config(app, lifespan="off", http="h11", ws="none", log_config=None,
                                      log_level="warning", access_log=False, ssl_certfile=tls_cert,
                                      ssl_keyfile=tls_key, timeout_graceful_shutdown=SHUTDOWN_TIMEOUT_S)
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    @property
    def scheme(self) -> str:
        return "https" if self._config.ssl_certfile else "http"

    async def start(self) -> int:
        """Bind and serve; return the bound port once uvicorn accepts connections."""
        sock = bind(self.host, self.requested_port)
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(self._config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="specdec-http")
        while not self._server.started:
            if self._task.done():
                sock.close()
                self._task.result()  # raises what went wrong
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        """Stop accepting, give running responses SHUTDOWN_TIMEOUT_S, cancel the rest."""
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._task), SHUTDOWN_TIMEOUT_S + 5)
        if not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
