#!/usr/bin/env python
"""The adaptive policy round by round: what it chose, what it expected, and what the round did.

For every round of an adaptive run: the K asked of each request (and with --tree-branches, the
depth of its tree's other root children: 0, a chain) with the request's acceptance estimate and
the committed tokens it expected (1 + the worth of its K tokens and other children), the seconds the
cost model predicted for the round that ran (its last solved fit, before the round is folded in;
none for a round that fed a prompt, which it does not price) against the measured verify / draft
/ coordinator seconds (with the policy's observe, as the model counts it), and the tokens
committed. One JSON line per round (--out), and a summary by the round's largest K on stdout.

    .venv/bin/python scripts/round_log.py --draft models/draft --temperature 0.8 --out rounds.jsonl

Where the adaptive row trails the best fixed K, this says which part of the model is off:
predicted against measured seconds (the cost fit), expected against committed tokens (the
acceptance estimates), or how many rounds sat at K = 0 ("settled": the last choice held).
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.speculation.speculation_policy import SpeculationPolicy, report_shape  # noqa: E402
from specdec import LocalEngine, SamplingParams  # noqa: E402
from specdec.tokenizer import load_tokenizer  # noqa: E402
from specdec_app.bench.prompts import chunks, load_prompts  # noqa: E402


def record_rounds(policy: SpeculationPolicy, rows: list[dict]) -> None:
    """Wrap this policy's choose and observe so that each round appends its row to `rows`."""
    choose, observe = policy.choose, policy.observe
    chosen: dict[str, tuple[float, float, int]] = {}  # req_id -> (alpha, expected tokens, side depth)

    def logged_choose(requests):
        ks = choose(requests)
        for request, k in zip(requests, ks):
            estimate, side = policy.estimates(request), policy.tree_shape(request.req_id)[1]
            chosen[request.req_id] = (estimate.alpha, estimate.expected_tokens(k, side), side)
        return ks

    def logged_observe(report, greedy):
        costs = policy.costs
        shape = report_shape(report, greedy)
        updates = [u for u in report.updates if u.error is None]
        rows.append({
            "round": len(rows), "requests": len(updates), "prefill": report.target_prefill > 0,
            "settled": not chosen,  # (the scheduler asked no choice: every K 0 by the last one)
            "k": [u.num_speculative_tokens for u in updates],
            "side": [chosen[u.req_id][2] if u.req_id in chosen else 0 for u in updates],
            "alpha": [chosen[u.req_id][0] if u.req_id in chosen else None for u in updates],
            "expected": sum(chosen[u.req_id][1] if u.req_id in chosen else 1.0 for u in updates),
            "committed": report.committed_tokens, "accepted": sum(u.accepted for u in updates),
            "proposed": sum(u.proposed for u in updates), "catch_up": report.draft_catch_up,
            "predicted_s": (costs.round_seconds(shape, solve=False)  # (the model prices no prompt)
                            if costs.rounds_seen >= 1 and not report.target_prefill else None),
            "measured_s": report.total_seconds, "verify_s": report.verify_seconds,
            "draft_s": report.draft_seconds, "overhead_s": report.overhead_seconds})
        chosen.clear()
        start = time.perf_counter()
        observe(report, greedy)
        # The cost model counts the policy's observe as the round's coordinator time: so does the log.
        observed = time.perf_counter() - start
        rows[-1]["measured_s"] += observed
        rows[-1]["overhead_s"] += observed

    policy.choose, policy.observe = logged_choose, logged_observe


def summary(rows: list[dict]) -> list[str]:
    """A markdown table by the round's largest K (rounds that fed a prompt apart): rounds, median
    predicted and measured milliseconds, mean expected and committed tokens."""
    groups = collections.defaultdict(list)
    for row in rows:
        groups[(max(row["k"], default=0), row["prefill"])].append(row)
    lines = ["| K | prefill | rounds | settled | predicted ms | measured ms | expected tokens | committed |",
             "|---|---|---|---|---|---|---|---|"]
    for (k, prefill), group in sorted(groups.items()):
        predicted = [r["predicted_s"] for r in group if r["predicted_s"] is not None]
        cells = [str(k), "yes" if prefill else "no", str(len(group)), str(sum(r["settled"] for r in group)),
                 f"{statistics.median(predicted) * 1e3:.2f}" if predicted else "-",
                 f"{statistics.median(r['measured_s'] for r in group) * 1e3:.2f}",
                 f"{statistics.mean(r['expected'] for r in group):.2f}",
                 f"{statistics.mean(r['committed'] for r in group):.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="models/target")
    parser.add_argument("--draft", default="models/draft", help="a checkpoint, or 'ngram'")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", default="models/heldout_prompts.jsonl")
    parser.add_argument("--count", type=int, default=8, help="prompts, spread over the file (default 8)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="prompts generated together (default 1)")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=5, help="K_max (default 5)")
    parser.add_argument("--tree-branches", type=int, default=1, help="the widest tree the policy may draft")
    parser.add_argument("--tree-side-depth", type=int, default=0, help="how deep its other children may grow")
    parser.add_argument("--out", default=None, metavar="FILE", help="also write a JSON line per round")
    args = parser.parse_args()
    if args.count < 1 or args.batch < 1 or args.new_tokens < 1:
        parser.error("--count, --batch and --new-tokens must be at least 1")
    engine = LocalEngine(target=args.target, draft=args.draft, num_speculative_tokens=args.num_speculative_tokens,
                         tree_branches=args.tree_branches, tree_side_depth=args.tree_side_depth)
    prompts, _ = load_prompts(args.prompts, args.count, load_tokenizer(args.target))
    rows: list[dict] = []
    record_rounds(engine.scheduler.policy, rows)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, ignore_eos=True)
    for group in chunks(prompts, args.batch):
        engine.generate(list(group), [params] * len(group))
    if args.out:
        Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{args.draft} T={args.temperature:g} batch {args.batch}: {len(rows)} rounds, "
          f"{sum(r['committed'] for r in rows)} tokens")
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
