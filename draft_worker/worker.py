"""The draft worker's one entry point per round, independent of how it is reached (in-process or gRPC)."""
from __future__ import annotations

from draft_worker.drafter import Drafter
from draft_worker.model_drafter import ModelDrafter
from draft_worker.ngram_drafter import NgramDrafter
from specdec.config import NGRAM, DraftConfig
from specdec.model.runner import ModelRunner
from specdec.round_types import DraftInfo, DraftProposal, DraftTask


class DraftWorker:
    def __init__(self, drafter: Drafter):
        self.drafter = drafter

    @classmethod
    def from_config(cls, config: DraftConfig) -> DraftWorker | None:
        """The worker for the drafter config.model names, or None when it is none."""
        drafter = build_drafter(config)
        return None if drafter is None else cls(drafter)

    def info(self) -> DraftInfo:
        return self.drafter.info()

    def propose(self, tasks: list[DraftTask], finished: list[str]) -> list[DraftProposal]:
        # Drop finished requests first so their cache blocks are free for this round.
        self.drafter.release(finished)
        return self.drafter.propose(tasks)


def build_drafter(config: DraftConfig) -> Drafter | None:
    """None (no speculation), prompt lookup for "ngram", else a draft model loaded from disk."""
    if config.kind == "none":
        return None
    if config.kind == NGRAM:
        return NgramDrafter(config.ngram_max, config.ngram_min, config.ngram_window)
    return ModelDrafter(ModelRunner.load(config, config.model), config.max_q_entries)
