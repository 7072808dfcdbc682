"""LocalEngine: the whole service in one process (draft, target and round loop, no network)."""
from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tqdm import tqdm

from coordinator.replicas.scheduler_thread import OnRound
from coordinator.rounds.request import Request, RequestStats
from specdec.config import ServiceConfig
from specdec.params import SamplingParams
from specdec.tokenizer import encode_prompt, render_chat
from specdec_app.embedded import LocalSchedulerFactory


@dataclass
class GenerationStats:
    acceptance_rate: float | None  # accepted / proposed draft tokens; None without a draft
    mean_accepted_length: float  # tokens committed per target forward pass
    target_forward_passes: int
    draft_forward_passes: int
    proposed_tokens: int
    accepted_tokens: int

    @staticmethod
    def from_request(stats: RequestStats) -> GenerationStats:
        return GenerationStats(stats.acceptance_rate, stats.mean_accepted_length, stats.target_forward_passes,
                               stats.draft_forward_passes, stats.proposed, stats.accepted)


@dataclass
class GenerationOutput:
    token_ids: list[int]  # generated tokens only
    text: str
    finish_reason: str
    stats: GenerationStats


class LocalEngine:
    """`LocalEngine(target, draft=None, **settings)` or `LocalEngine(config=ServiceConfig(...))`.

    `target`: a checkpoint directory (default: the shipped target); `draft`: None (no
    speculation), "ngram" or a checkpoint directory sharing the target's tokenizer; `settings`:
    any flat setting of specdec.config (num_speculative_tokens, max_batch_size, device, dtype,
    kv_cache_blocks, ...). `on_round(report)` is called with every RoundReport.

    `generate(prompts, params)` completes text or token-id prompts; `chat(conversations, params)`
    answers conversations, each rendered with the model's chat template first (the same rendering
    as the servers'). Both batch internally and return one GenerationOutput per input, in order.
    """

    def __init__(self, target: str | None = None, draft: str | None = None, *,
                 config: ServiceConfig | None = None, on_round: OnRound | None = None, **settings):
        if config is None:
            config = ServiceConfig.from_settings(draft=draft, **({"target": str(target)} if target else {}),
                                                 **settings)
        elif target is not None or draft is not None or settings:
            raise TypeError("give either config or target/draft/settings, not both")
        self.config = config
        factory = LocalSchedulerFactory(config)
        self.scheduler = factory()
        self.tokenizer = factory.tokenizer
        self.target_worker, self.draft_worker = factory.target_worker, factory.draft_worker
        self.on_round = on_round
        self._ids = itertools.count()

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 num_speculative_tokens: int | None = None, progress: bool = False) -> list[GenerationOutput]:
        """Generate for every prompt (batched internally); outputs come back in prompt order."""
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list (of strings or of token-id lists), not a single string")
        return self._run([self.encode(p) for p in prompts], params, num_speculative_tokens, progress)

    def chat(self, conversations: Sequence[Sequence[Mapping[str, str]]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             num_speculative_tokens: int | None = None, progress: bool = False) -> list[GenerationOutput]:
        """Answer every conversation (a list of {"role": "system" | "user" | "assistant",
        "content": text} messages), rendered with the model's chat template; outputs come back in
        order. ValueError when the model has no chat template or a message is malformed."""
        if not isinstance(conversations, Sequence) or isinstance(conversations, str) or (
                conversations and isinstance(conversations[0], Mapping)):
            raise TypeError("conversations must be a list of conversations (each a list of messages), "
                            "e.g. engine.chat([[{'role': 'user', 'content': 'hi'}]])")
        return self._run([render_chat(self.tokenizer, c) for c in conversations], params, num_speculative_tokens,
                         progress)

    def _run(self, prompt_ids: list[list[int]], params: SamplingParams | Sequence[SamplingParams] | None,
             num_speculative_tokens: int | None, progress: bool) -> list[GenerationOutput]:
        params = params if params is not None else SamplingParams()
        per_prompt = [params] * len(prompt_ids) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompt_ids):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompt_ids)} prompts")
        requests = [Request(req_id=f"local-{next(self._ids)}", prompt_ids=ids, params=sp,
                            num_speculative_tokens=num_speculative_tokens)
                    for ids, sp in zip(prompt_ids, per_prompt)]
        for request in requests:  # validate all before queueing any, so a bad prompt queues nothing
            self.scheduler.validate(request)
        for request in requests:
            self.scheduler.add_request(request)
        tokens: dict[str, list[int]] = {r.req_id: [] for r in requests}
        texts: dict[str, list[str]] = {r.req_id: [] for r in requests}
        done: dict[str, GenerationOutput] = {}
        bar = None
        if progress:
            bar = tqdm(total=sum(sp.max_new_tokens for sp in per_prompt), unit="tok", desc="generate")
        try:
            while len(done) < len(requests):
                for update in self._step().updates:
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
        self._step()  # flush releases so the caches are empty between calls
        return [done[r.req_id] for r in requests]

    def _step(self):
        report = self.scheduler.step()
        if self.on_round is not None:
            self.on_round(report)
        return report
