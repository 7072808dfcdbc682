"""specdec's LocalEngine as a benchmarked system (plain, draft model or n-gram; K adaptive or
fixed), timed on the bench's token-id prompts, with its rounds tallied: seconds in each worker,
per-token acceptance, and the K asked of each request in each round.

Like every system it gets the same max_new_tokens (EOS never ends a sequence early:
`ignore_eos=True`), the same torch threads, and one warm-up call before it is timed.
tokens/s = generated tokens / wall-clock seconds of the timed calls.
"""
from __future__ import annotations

import gc
import time
from collections import Counter

from specdec.config import WorkerConfig
from specdec.kv_cache import blocks_for_tokens
from specdec.params import SamplingParams
from specdec_app.bench.prompts import chunks
from specdec_app.bench.results import SYSTEMS, Mode, RunResult, speculation_rates
from specdec_app.engine import LocalEngine


def kv_blocks_for(prompts: list[list[int]], max_new: int, max_k: int, max_batch: int) -> int:
    """KV-cache blocks for a full batch of the longest prompt plus its output and draft tokens."""
    tokens = max(len(p) for p in prompts) + max_new + max_k + 2
    return max_batch * (blocks_for_tokens(tokens, WorkerConfig().kv_block_size) + 2) + 8


class _RoundTally:
    """Adds up the RoundReports of a run: seconds in each worker, per-token acceptance, and the K
    asked of each request in each round that ran.

    A round that proposes k tokens and keeps a tests a + 1 of them when a < k (the first rejected
    one ends the round), a when a == k. accepted / tested is the per-token acceptance probability
    that the speedup formula assumes; accepted / proposed (the engine's acceptance rate) also counts
    the tokens after a rejection that were never tested, so it is lower.
    """

    def __init__(self):
        self.draft_seconds = self.verify_seconds = 0.0
        self.tested = self.accepted = self.rounds_without_draft = 0
        self.k_counts: Counter[int] = Counter()
        self.draft_steps = 0
        self.nodes = self.passes_with_draft = self.tree_passes = 0
        self.by_depth: list[list[int]] = []  # [accepted, tested] at depth 1, 2, ..

    def __call__(self, report) -> None:
        self.draft_seconds += report.draft_seconds
        self.verify_seconds += report.verify_seconds
        if report.ran and report.updates:
            asked = [update.num_speculative_tokens for update in report.updates]
            self.k_counts.update(asked)
            self.draft_steps += max(asked)  # a batched drafter steps as often as the longest ask
        for update in report.updates:
            if update.proposed == 0:
                self.rounds_without_draft += int(report.ran)
                continue
            self.accepted += update.accepted
            self.tested += update.accepted + (1 if update.accepted < update.proposed else 0)
            self.nodes += update.proposed if update.tree_nodes is None else update.tree_nodes
            self.passes_with_draft += 1
            self.tree_passes += update.tree_nodes is not None
            while len(self.by_depth) < update.proposed:
                self.by_depth.append([0, 0])
            for depth in range(min(update.accepted + 1, update.proposed)):  # depths tested: up to the first miss
                self.by_depth[depth][0] += int(depth < update.accepted)
                self.by_depth[depth][1] += 1


class EngineSystem:
    """A LocalEngine (plain, draft model or n-gram; K adaptive or fixed), timed per draft/verify call.

    Sampled requests carry no seed, like typical traffic: a seeded request's K follows a restricted
    rule (its own history only), so seeding them would not measure the adaptive policy that serves.
    """

    def __init__(self, key: str, target: str, draft: str | None, k: int, kv_cache_blocks: int,
                 max_batch_size: int, adaptive: bool = True, cpu_kernels: bool = True,
                 weights: tuple[str, str] = ("auto", "auto"), tree_branches: int = 1, tree_side_depth: int = 0):
        """weights: the target's and the draft's weight formats (specdec.model.quantized);
        tree_branches, tree_side_depth: more than 1 branch drafts token trees of that shape (scheduler)."""
        self.key = key
        self.label = SYSTEMS[key].label
        self.k = k if draft is not None else None
        self.adaptive = adaptive if draft is not None else None
        self.engine = LocalEngine(target, draft=draft, num_speculative_tokens=k if draft else 0,
                                  adaptive=adaptive, kv_cache_blocks=kv_cache_blocks, max_batch_size=max_batch_size,
                                  cpu_kernels=cpu_kernels, target_weights=weights[0], draft_weights=weights[1],
                                  tree_branches=tree_branches, tree_side_depth=tree_side_depth)

    def run(self, prompts: list[list[int]], batch: int, mode: Mode, max_new_tokens: int, seed: int,
            k: int | None = None, bar=None, prompt_set: str = "") -> RunResult:
        """`seed` is unused (sampled requests are unseeded, see the class); HFSystem.run takes it."""
        k = self.k if k is None else k
        result = RunResult(system=self.key, label=self.label, batch=batch, mode=mode.name, k=k,
                           prompt_set=prompt_set, adaptive=self.adaptive, prompts=len(prompts))
        tally = self.engine.on_round = _RoundTally()
        proposed = accepted = rounds = draft_passes = generated = 0
        gc.collect()
        start = time.perf_counter()
        for group in chunks(prompts, batch):
            params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=mode.temperature, seed=None,
                                     ignore_eos=True)] * len(group)
            outputs = self.engine.generate(list(group), params, num_speculative_tokens=k if self.k is not None else 0)
            for out in outputs:
                result.outputs.append(list(out.token_ids))
                generated += len(out.token_ids)
                proposed += out.stats.proposed_tokens
                accepted += out.stats.accepted_tokens
                rounds += out.stats.target_forward_passes
                draft_passes += out.stats.draft_forward_passes
            if bar is not None:
                bar.update(sum(len(o.token_ids) for o in outputs))
        result.seconds = time.perf_counter() - start
        self.engine.on_round = None
        result.tokens = generated
        result.tokens_per_s = generated / result.seconds if result.seconds > 0 else None
        result.target_forward_passes = rounds
        result.mean_accepted_length = generated / rounds if rounds else None
        if self.k is not None:
            result.proposed, result.accepted, result.draft_forward_passes = proposed, accepted, draft_passes
            result.tested = tally.tested
            result.rounds_without_draft = tally.rounds_without_draft
            result.k_histogram = {str(n): tally.k_counts.get(n, 0) for n in range(max([k, *tally.k_counts]) + 1)}
            result.draft_steps = tally.draft_steps
            result.acceptance_by_depth = [round(a / t, 4) for a, t in tally.by_depth if t]
            result.nodes_per_pass = tally.nodes / tally.passes_with_draft if tally.passes_with_draft else None
            result.tree_share = tally.tree_passes / tally.passes_with_draft if tally.passes_with_draft else None
            speculation_rates(result)
        result.draft_seconds = tally.draft_seconds
        result.verify_seconds = tally.verify_seconds
        result.other_seconds = result.seconds - result.draft_seconds - result.verify_seconds
        return result

    def warm_up(self, prompts: list[list[int]], batch: int, mode: Mode, seed: int, k: int | None = None) -> None:
        self.run(prompts[:batch], batch, mode, max_new_tokens=8, seed=seed, k=k)
