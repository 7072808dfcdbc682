"""How the coordinator reaches the workers: two small interfaces.

The in-process workers (target_worker.worker.TargetWorker, draft_worker.worker.DraftWorker)
implement them directly; coordinator.rounds.grpc_clients implements them over the network. The round
loop only sees these, so the same loop runs in a unit test, in the embedded engine and in a
cluster.
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
