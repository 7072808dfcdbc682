"""LocalEngine: the whole service in one process (draft, target and round loop, no network)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from coordinator.clients import LocalDraftClient, LocalTargetClient
from coordinator.request import Request, RequestStats
from coordinator.scheduler import Scheduler
from draft_worker.worker import DraftWorker, build_drafter
from specdec.model.llama import LlamaModel
from specdec.params import SamplingParams
from specdec.tokenizer import load_tokenizer
from target_worker.worker import TargetWorker


@dataclass
class GenerationStats:
    acceptance_rate: float | None  # accepted / proposed draft tokens; None without a draft
    mean_accepted_length: float  # tokens committed per target forward pass
    target_forward_passes: int
    draft_forward_passes: int
    proposed_tokens: int
    accepted_tokens: int

    @staticmethod
    def from_request(stats: RequestStats) -> "GenerationStats":
        return GenerationStats(stats.acceptance_rate, stats.mean_accepted_length, stats.target_forward_passes,
                               stats.draft_forward_passes, stats.proposed, stats.accepted)


@dataclass
class GenerationOutput:
    token_ids: list[int]  # generated tokens only
    text: str
    finish_reason: str
    stats: GenerationStats


def build_local_workers(target: str, draft: str | None = None, device: str = "cpu", dtype: str = "float32",
                        kv_cache_blocks: int | None = None, kv_block_size: int = 16
                        ) -> tuple[TargetWorker, DraftWorker | None]:
    """In-process target and (optional) draft workers: shared by LocalEngine and the embedded server.

    `draft` is None (no speculation), "ngram" or a checkpoint directory sharing the target's tokenizer.
    """
    target_model = LlamaModel.load(target, device, dtype)
    target_worker = TargetWorker(target_model, kv_cache_blocks, kv_block_size, model_name=str(target))
    if draft is None:
        return target_worker, None
    drafter = build_drafter(draft, device, dtype, num_blocks=kv_cache_blocks, block_size=kv_block_size)
    if draft != "ngram" and drafter.info().vocab_size != target_model.config.vocab_size:
        raise ValueError(f"draft vocabulary ({drafter.info().vocab_size}) differs from the target's "
                         f"({target_model.config.vocab_size}): they must share a tokenizer")
    return target_worker, DraftWorker(drafter)


class LocalEngine:
    def __init__(self, target: str, draft: str | None = None, num_speculative_tokens: int = 5,
                 device: str = "cpu", dtype: str = "float32", max_batch_size: int = 32,
                 kv_cache_blocks: int | None = None, kv_block_size: int = 16):
        self.tokenizer = load_tokenizer(target)
        self.target_worker, self.draft_worker = build_local_workers(target, draft, device, dtype,
                                                                    kv_cache_blocks, kv_block_size)
        self.scheduler = Scheduler(
            LocalTargetClient(self.target_worker),
            LocalDraftClient(self.draft_worker) if self.draft_worker else None,
            self.tokenizer, num_speculative_tokens, max_batch_size)
        self._ids = itertools.count()

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass prompts as lists of token ids")
            return list(self.tokenizer(prompt)["input_ids"])
        return [int(t) for t in prompt]

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 num_speculative_tokens: int | None = None, progress: bool = False) -> list[GenerationOutput]:
        """Generate for every prompt (batched internally); outputs come back in prompt order."""
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list (of strings or of token-id lists), not a single string")
        params = params if params is not None else SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        requests = [Request(req_id=f"local-{next(self._ids)}", prompt_ids=self.encode(p), params=sp,
                            num_speculative_tokens=num_speculative_tokens)
                    for p, sp in zip(prompts, per_prompt)]
        for request in requests:  # validate all before queueing any, so a bad prompt queues nothing
            self.scheduler.validate(request)
        for request in requests:
            self.scheduler.add_request(request)
        tokens: dict[str, list[int]] = {r.req_id: [] for r in requests}
        texts: dict[str, list[str]] = {r.req_id: [] for r in requests}
        done: dict[str, GenerationOutput] = {}
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=sum(sp.max_new_tokens for sp in per_prompt), unit="tok", desc="generate")
        try:
            while len(done) < len(requests):
                for update in self.scheduler.step():
                    if update.req_id not in tokens:
                        continue
                    tokens[update.req_id].extend(update.token_ids)
                    texts[update.req_id].append(update.text)
                    if bar is not None:
                        bar.update(len(update.token_ids))
                    if update.finished:
                        if update.error and update.finish_reason == "error":
                            raise RuntimeError(f"request {update.req_id} failed: {update.error}")
                        done[update.req_id] = GenerationOutput(
                            token_ids=tokens[update.req_id], text="".join(texts[update.req_id]),
                            finish_reason=update.finish_reason, stats=GenerationStats.from_request(update.stats))
        except BaseException:
            for request in requests:
                if request.req_id not in done:
                    self.scheduler.abort(request.req_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        self.scheduler.step()  # flush releases so the caches are empty between calls
        return [done[r.req_id] for r in requests]
