#!/usr/bin/env python
"""What a round at K = 0 costs beyond the target's pass: a speculating engine whose rounds all ask
nothing of the drafter against plain decoding (issue 23: "K = 0 is free"). Microseconds per round
outside the target's verify pass (the scheduler, the policy, the draft call it skips), timed
inside real rounds: after a forward pass the caches are cold, and Python costs several times
what a loop of the same calls would.

    .venv/bin/python scripts/k0_round_overhead.py                     # shipped pair, T = 0.8
    .venv/bin/python scripts/k0_round_overhead.py --draft DIR --temperature 0 --batch 8

The default draft is one whose drafting never pays on the shipped target: the shipped draft with
noise (specdec bench-policy's "draft+noise 2.4", built there and cached), so nearly every round
is at K = 0; any draft works, and only rounds where every request asked 0 are counted.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec import LocalEngine, SamplingParams  # noqa: E402
from specdec.config import SHIPPED_DRAFT, SHIPPED_TARGET  # noqa: E402


def outside_the_pass_us(engine: LocalEngine, prompts: list, params: SamplingParams,
                        batch: int = 1) -> tuple[float, int]:
    """Mean microseconds of a K = 0 round's step() outside its verify round, and the rounds;
    prompts served `batch` at a time."""
    scheduler, spent, counted = engine.scheduler, [0.0], [0]
    verify, step = scheduler._verify_round, scheduler.step
    inside = [0.0]

    def timed_verify(*args, **kwargs):
        start = time.perf_counter()
        try:
            return verify(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - start

    def timed_step():
        inside[0], start = 0.0, time.perf_counter()
        report = step()
        if report.ran and report.updates and not any(u.num_speculative_tokens for u in report.updates):
            spent[0] += time.perf_counter() - start - inside[0]
            counted[0] += 1
        return report

    scheduler._verify_round, scheduler.step = timed_verify, timed_step
    engine.generate(prompts[:batch], [params] * len(prompts[:batch]))  # (warm)
    spent[0], counted[0] = 0.0, 0
    for first in range(0, len(prompts), batch):
        group = prompts[first:first + batch]
        engine.generate(group, [params] * len(group))
    scheduler._verify_round, scheduler.step = verify, step
    return spent[0] / max(counted[0], 1) * 1e6, counted[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(SHIPPED_TARGET))
    parser.add_argument("--draft", default=None, help="default: the shipped draft with noise 2.4 (built once)")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--prompts", default=str(SHIPPED_TARGET.parent / "heldout_prompts.jsonl"))
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="prompts served together (default 1)")
    args = parser.parse_args()
    if args.draft is None:
        from specdec_app.bench.policy_command import DEFAULT_CACHE, noisy_copy
        args.draft = noisy_copy(str(SHIPPED_DRAFT), 2.4, DEFAULT_CACHE)
    prompts = [json.loads(line)["prompt"] for line in open(args.prompts)][:args.num_prompts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, ignore_eos=True)
    engines = [LocalEngine(args.target, max_batch_size=args.batch),
               LocalEngine(args.target, draft=args.draft, num_speculative_tokens=5, max_batch_size=args.batch)]
    (plain_us, plain_rounds), (spec_us, spec_rounds) = [outside_the_pass_us(e, prompts, params, args.batch)
                                                        for e in engines]
    print(f"outside the target's pass, per round at K = 0: plain {plain_us:.0f} us ({plain_rounds} rounds), "
          f"speculating {spec_us:.0f} us ({spec_rounds} rounds): {spec_us - plain_us:+.0f} us a round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
