"""The Drafter interface: what any proposer of draft tokens must do."""
from __future__ import annotations

from abc import ABC, abstractmethod

from specdec.kv_cache import PagedKVCache
from specdec.round_types import DraftInfo, DraftProposal, DraftTask


class Drafter(ABC):
    @property
    def kv_cache(self) -> PagedKVCache | None:
        """The drafter's own KV cache, if it keeps one (audited by tests and the load test)."""
        return None

    @abstractmethod
    def info(self) -> DraftInfo: ...

    @abstractmethod
    def propose(self, tasks: list[DraftTask]) -> list[DraftProposal]:
        """One proposal per task, in order. A task's new_tokens are recorded even when it asks for
        no speculative tokens."""

    @abstractmethod
    def release(self, req_ids: list[str]) -> None:
        """Forget these requests (finished, cancelled or failed); unknown ids are ignored."""
