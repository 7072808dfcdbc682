"""The draft worker's one entry point per round, independent of how it is reached (in-process or gRPC)."""
from __future__ import annotations

from draft_worker.drafter import Drafter
from specdec.round_types import DraftInfo, DraftProposal, DraftTask


class DraftWorker:
    def __init__(self, drafter: Drafter):
        self.drafter = drafter

    def info(self) -> DraftInfo:
        return self.drafter.info()

    def propose(self, tasks: list[DraftTask], finished: list[str]) -> list[DraftProposal]:
        # Drop finished requests first so their cache blocks are free for this round.
        self.drafter.release(finished)
        return self.drafter.propose(tasks)


def build_drafter(draft: str, device: str = "cpu", dtype: str = "float32", **kwargs) -> Drafter:
    """"ngram" -> prompt lookup; anything else is a checkpoint directory for a draft model.
    kwargs (KV-cache sizing) apply to the model drafter only; the n-gram drafter keeps no cache."""
    if draft == "ngram":
        from draft_worker.ngram_drafter import NgramDrafter
        return NgramDrafter()
    from draft_worker.model_drafter import ModelDrafter
    from specdec.model.llama import LlamaModel
    return ModelDrafter(LlamaModel.load(draft, device, dtype), **kwargs)
