"""Serve a draft worker over gRPC (specdec.v1.DraftWorker).

Wraps any object with `info()` and `propose(tasks, finished)`. A worker exception ends only the
current Rounds stream, with INVALID_ARGUMENT for ValueError and INTERNAL otherwise; the server
keeps serving and the client opens a new stream for its next round.
"""
from __future__ import annotations

import grpc

from specdec import wire
from specdec.v1 import worker_pb2, worker_pb2_grpc
from specdec.worker_service import RoundsServicer, serve_worker

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name


class DraftWorkerServicer(RoundsServicer, worker_pb2_grpc.DraftWorkerServicer):
    kind = "draft"

    def _info(self):
        return wire.draft_info_to_proto(self.worker.info())

    def _round(self, request: worker_pb2.DraftRoundRequest) -> worker_pb2.DraftRoundReply:
        tasks, finished = wire.draft_round_from_proto(request)
        return wire.draft_reply_to_proto(self.worker.propose(tasks, finished))


def serve(worker, address: str = "127.0.0.1:0", max_workers: int = 8) -> tuple[grpc.Server, int]:
    """Start a draft worker server on `address` (loopback by default: workers are internal)."""
    return serve_worker(DraftWorkerServicer(worker), worker_pb2_grpc.add_DraftWorkerServicer_to_server,
                        SERVICE_NAME, address, max_workers)
