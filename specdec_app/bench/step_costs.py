"""The cost ratio c: per-step seconds of the target and the draft in specdec's runtime at the
bench's context lengths, and of the target's (K+1)-token verify pass.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from specdec.config import DraftConfig, WorkerConfig
from specdec.model.runner import ModelRunner


def _time_steps(runner, contexts: list[list[int]], steps: int, tokens_per_step: int = 1) -> float:
    """(median, min) seconds of one forward pass that feeds `tokens_per_step` tokens to every sequence
    (contexts already prefilled); the cache is rolled back after each pass so the context stays fixed."""
    ids = [f"bench-step-{i}" for i in range(len(contexts))]
    cache = runner.cache
    for seq_id in ids:
        cache.add_sequence(seq_id)
    try:
        runner.run(ids, [list(c) for c in contexts], [1] * len(ids))
        lengths = [cache.length(s) for s in ids]
        feed = [[c[-1]] * tokens_per_step for c in contexts]
        times: list[float] = []
        for step in range(steps + 3):
            t0 = time.perf_counter()
            runner.run(ids, feed, [tokens_per_step] * len(ids))
            elapsed = time.perf_counter() - t0
            for seq_id, length in zip(ids, lengths):
                cache.truncate_to(seq_id, length)
            if step >= 3:  # the first passes warm up allocator and caches
                times.append(elapsed)
        return statistics.median(times), min(times)
    finally:
        for seq_id in ids:
            cache.free_sequence(seq_id)


def measure_step_costs(target: str, draft: str | None, contexts_by_set: dict[str, list[list[int]]],
                       batch_sizes: Sequence[int], k: int, steps: int = 30, kv_cache_blocks: int = 256,
                       weights: tuple[str, str] = ("auto", "auto")) -> dict:
    """Per-step seconds of the target and the draft in specdec's runtime, and c = draft / target,
    for each prompt set: {set name: {"steps_timed": ..., "by_batch": {"1": {...}, ...}}}.

    One decode step = one new token per sequence at the benchmark's context lengths (the set's
    prompts). Also the cost of a (K+1)-token verify pass relative to a 1-token step, which the
    formula assumes to be 1. weights: the target's and the draft's weight formats.
    """
    target_runner = ModelRunner.load(WorkerConfig(kv_cache_blocks=kv_cache_blocks, weights=weights[0]), target)
    draft_config = DraftConfig(kv_cache_blocks=kv_cache_blocks, weights=weights[1])
    draft_runner = ModelRunner.load(draft_config, draft) if draft else None
    by_set: dict = {}
    for name, contexts in contexts_by_set.items():
        out: dict = {"steps_timed": steps, "by_batch": {}}
        for b in batch_sizes:
            ctx = [contexts[i % len(contexts)] for i in range(b)]
            t_target, min_target = _time_steps(target_runner, ctx, steps)
            t_verify, min_verify = _time_steps(target_runner, ctx, steps, tokens_per_step=k + 1)
            entry = {"target_step_s": t_target, "target_verify_pass_s": t_verify,
                     "verify_pass_over_step": t_verify / t_target, "verify_tokens": k + 1,
                     "min_target_step_s": min_target, "min_target_verify_pass_s": min_verify}
            if draft_runner is not None:
                t_draft, min_draft = _time_steps(draft_runner, ctx, steps)
                entry.update(draft_step_s=t_draft, c=t_draft / t_target, min_draft_step_s=min_draft,
                             c_from_min=min_draft / min_target)
            out["by_batch"][str(b)] = entry
        by_set[name] = out
    return by_set
