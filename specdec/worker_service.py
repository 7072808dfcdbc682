"""gRPC plumbing shared by the draft and the target worker servers.

Both workers serve the same shape (a unary Info and a bidirectional Rounds stream, one reply per
round, plus grpc.health.v1); only the messages and the worker method differ. Keeping the serving
rules here means both workers map errors and bind addresses identically.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec import wire

log = logging.getLogger(__name__)


def run_as_status(context: grpc.ServicerContext, kind: str, fn, *args):
    """Call fn; turn its exception into a gRPC status (context.abort raises, ending the RPC).

    ValueError means the request was bad (INVALID_ARGUMENT); anything else is INTERNAL. Either
    way only this call ends: the server keeps serving.
    """
    try:
        return fn(*args)
    except ValueError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e) or type(e).__name__)
    except Exception as e:  # noqa: BLE001 - any worker failure must become a status, not a dead server
        log.exception("%s worker call failed", kind)
        context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")


class RoundsServicer:
    """Info + Rounds for one worker. Subclasses implement `_info()` and `_round(request)`."""

    kind = "worker"

    def __init__(self, worker):
        self.worker = worker
        # Workers keep per-request state and are not thread-safe; a reconnecting client (or a
        # second coordinator) could otherwise run two rounds at once.
        self._lock = threading.Lock()

    def Info(self, request, context):
        return run_as_status(context, self.kind, self._info)

    def Rounds(self, request_iterator, context):
        for request in request_iterator:
            yield run_as_status(context, self.kind, self._locked_round, request)

    def _locked_round(self, request):
        with self._lock:
            return self._round(request)

    def _info(self):
        raise NotImplementedError

    def _round(self, request):
        raise NotImplementedError


def serve_worker(servicer: RoundsServicer, add_to_server: Callable, service_name: str,
                 address: str, max_workers: int) -> tuple[grpc.Server, int]:
    """Start a server for `servicer` on `address`; return (server, bound_port).

    Port 0 picks a free one. Each open Rounds stream holds one of the max_workers threads for its
    lifetime. Also serves grpc.health.v1 for readiness probes.
    """
    kind = servicer.kind
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"{kind}-grpc"),
        options=list(wire.GRPC_SERVER_OPTIONS),
    )
    add_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    for name in ("", service_name):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise RuntimeError(f"{kind} worker could not bind {address}: {e}") from e
    if port == 0:
        raise RuntimeError(f"{kind} worker could not bind {address}")
    server.start()
    log.info("%s worker serving on %s (port %d)", kind, address, port)
    return server, port
