"""Serve a draft worker over gRPC (specdec.v1.DraftWorker).

Wraps any object with `info()` and `propose(tasks, finished)`. A worker exception ends only the
current Rounds stream, with INVALID_ARGUMENT for ValueError and INTERNAL otherwise; the server
keeps serving and the client opens a new stream for its next round.
"""
from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec import wire
from specdec.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name


def _run(context: grpc.ServicerContext, fn, *args):
    """Call fn; turn its exception into a gRPC status (context.abort raises, ending the RPC)."""
    try:
        return fn(*args)
    except ValueError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e) or type(e).__name__)
    except Exception as e:  # noqa: BLE001 - any worker failure must become a status, not a dead server
        log.exception("draft worker call failed")
        context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")


class DraftWorkerServicer(worker_pb2_grpc.DraftWorkerServicer):
    def __init__(self, worker):
        self.worker = worker
        # Workers keep per-request state and are not thread-safe; a reconnecting client (or a
        # second coordinator) could otherwise run two rounds at once.
        self._lock = threading.Lock()

    def Info(self, request, context):
        return _run(context, lambda: wire.draft_info_to_proto(self.worker.info()))

    def Rounds(self, request_iterator, context):
        for request in request_iterator:
            yield _run(context, self._round, request)

    def _round(self, request: worker_pb2.DraftRoundRequest) -> worker_pb2.DraftRoundReply:
        tasks, finished = wire.draft_round_from_proto(request)
        with self._lock:
            proposals = self.worker.propose(tasks, finished)
        return wire.draft_reply_to_proto(proposals)


def serve(worker, address: str = "127.0.0.1:0", max_workers: int = 8) -> tuple[grpc.Server, int]:
    """Start a server for `worker` on `address` (loopback by default: workers are internal).

    Returns (server, bound_port); port 0 picks a free one. Each open Rounds stream holds one of
    the max_workers threads for its lifetime. Also serves grpc.health.v1 for readiness probes.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="draft-grpc"),
        options=list(wire.GRPC_SERVER_OPTIONS),
    )
    worker_pb2_grpc.add_DraftWorkerServicer_to_server(DraftWorkerServicer(worker), server)
    health_servicer = health.HealthServicer()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise RuntimeError(f"draft worker could not bind {address}: {e}") from e
    if port == 0:
        raise RuntimeError(f"draft worker could not bind {address}")
    server.start()
    log.info("draft worker serving on %s (port %d)", address, port)
    return server, port
