"""How the coordinator reaches the workers: two small interfaces, in-process or over gRPC.

The round loop only sees these, so the same loop runs in a unit test, in the embedded engine,
and in a cluster (see coordinator.grpc_clients for the networked implementations).
"""
from __future__ import annotations

from typing import Protocol

from specdec.round_types import DraftInfo, DraftProposal, DraftTask, TargetInfo, VerifyResult, VerifyTask


class DraftClient(Protocol):
    def info(self) -> DraftInfo: ...

    def propose(self, tasks: list[DraftTask], finished: list[str]) -> list[DraftProposal]: ...


class TargetClient(Protocol):
    def info(self) -> TargetInfo: ...

    def verify(self, tasks: list[VerifyTask], finished: list[str]) -> VerifyResult: ...


class LocalDraftClient:
    """Plain method calls on a draft worker living in this process."""

    def __init__(self, worker):
        self.worker = worker

    def info(self) -> DraftInfo:
        return self.worker.info()

    def propose(self, tasks: list[DraftTask], finished: list[str]) -> list[DraftProposal]:
        return self.worker.propose(tasks, finished)


class LocalTargetClient:
    def __init__(self, worker):
        self.worker = worker

    def info(self) -> TargetInfo:
        return self.worker.info()

    def verify(self, tasks: list[VerifyTask], finished: list[str]) -> VerifyResult:
        return self.worker.verify(tasks, finished)
