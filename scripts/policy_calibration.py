#!/usr/bin/env python
"""Is the speculation policy's acceptance model calibrated? For every drafting round of an
adaptive run (batch 1, one request at a time), the committed tokens the policy expected at the K
it chose against what the round committed, by K; beside them what one acceptance rate pooled over
the run (the geometric model) and per-depth conditional rates (P(accepted at depth d | depth d
tested), which stay exact when acceptance varies between rounds) predict for that K.

    .venv/bin/python scripts/policy_calibration.py --target models/target --draft models/draft \
        --temperature 0.8 --prompts models/heldout_prompts.jsonl --count 40 --new-tokens 96

An expectation above what rounds commit at the K's the policy picks, while the pooled rates agree
with the rounds, is selection bias (the winner's curse): a long K is chosen where a request's own
estimate is high by chance.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from round_log import record_rounds  # noqa: E402  (this folder: the policy's rounds as they run)

from specdec import LocalEngine, SamplingParams  # noqa: E402


def acceptance_by_depth(rounds: list[tuple[int, float, int, int]]) -> tuple[float, dict[int, float], dict]:
    """(acceptance pooled over every tested token, {depth: accepted / tested at that depth}, tested
    per depth) of rounds (K, expected, accepted, proposed): a token is tested up to the first
    rejection, and tokens never proposed are not tested."""
    tested, accepted = collections.Counter(), collections.Counter()
    for _, _, hits, proposed in rounds:
        for depth in range(1, min(hits + 1, proposed) + 1):
            tested[depth] += 1
            accepted[depth] += depth <= hits
    pooled = sum(accepted.values()) / max(sum(tested.values()), 1)
    return pooled, {d: accepted[d] / tested[d] for d in sorted(tested)}, tested


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="models/target")
    parser.add_argument("--draft", default="models/draft")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", default="models/heldout_prompts.jsonl")
    parser.add_argument("--count", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=96)
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in open(args.prompts)][:args.count]
    engine = LocalEngine(target=args.target, draft=args.draft, num_speculative_tokens=5)
    logged: list[dict] = []
    record_rounds(engine.scheduler.policy, logged)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature)
    for prompt in prompts:  # one at a time: batch 1
        engine.generate([prompt], params)
    # (K, expected, accepted, proposed) of each drafting round: at batch 1 a round is its request's
    rounds = [(row["k"][0], row["expected"], row["accepted"], row["proposed"]) for row in logged if row["k"][0]]
    pooled, rates, tested = acceptance_by_depth(rounds)
    print(f"{args.draft} T={args.temperature}: {len(rounds)} drafting rounds; acceptance pooled {pooled:.3f}, "
          "by depth " + " ".join(f"{d}: {r:.2f} ({tested[d]})" for d, r in rates.items()))
    weights = engine.scheduler.policy.prior_weights  # (each kind's, as learnt by the end of the run)
    print("prior weight: " + ", ".join(f"{'greedy' if kind else 'sampled'} {w.weight:g}"
                                       for kind, w in weights.items()))
    print("| K | rounds | policy expected | committed | pooled geometric | per-depth rates |")
    print("|---|---|---|---|---|---|")
    by_k = collections.defaultdict(list)
    for k, expected, hits, _ in rounds:
        by_k[k].append((expected, 1 + hits))
    for k in sorted(by_k):
        reach, per_depth = 1.0, 1.0
        for depth in range(1, k + 1):
            reach *= rates.get(depth, 0.0)
            per_depth += reach
        geometric = 1 + sum(pooled ** d for d in range(1, k + 1))
        rows = by_k[k]
        print(f"| {k} | {len(rows)} | {statistics.mean(r[0] for r in rows):.2f} | "
              f"{statistics.mean(r[1] for r in rows):.2f} | {geometric:.2f} | {per_depth:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
