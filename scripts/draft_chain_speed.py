#!/usr/bin/env python
"""A draft's chain in one C call against the same drafter stepping in Python, beside plain decoding.

Three engines in one process (plain; speculating with the draft's passes stepped in Python;
speculating with the whole chain in one `draft_chain` call: the same tokens), each timed on the
same prompts in turn, the order rotated every repetition. Prints tokens/s (medians), the seconds
spent in draft calls, and each repetition's ratios: the chain over the stepping drafter and over
plain decoding.

    .venv/bin/python scripts/draft_chain_speed.py --temperature 0.8 --fixed-k 2
    .venv/bin/python scripts/draft_chain_speed.py --prompts models/prose_prompts.jsonl   # adaptive K
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec import LocalEngine, SamplingParams  # noqa: E402
from specdec.config import SHIPPED_DRAFT, SHIPPED_TARGET  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(SHIPPED_TARGET))
    parser.add_argument("--draft", default=str(SHIPPED_DRAFT))
    parser.add_argument("--prompts", default=str(SHIPPED_TARGET.parent / "heldout_prompts.jsonl"))
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--fixed-k", type=int, default=None, help="K in every round (default: adaptive, K_max 5)")
    parser.add_argument("--batch", type=int, default=1, help="prompts served together (default 1)")
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in open(args.prompts)][:args.num_prompts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, ignore_eos=True)
    k, adaptive = (5, True) if args.fixed_k is None else (args.fixed_k, False)
    engines = {"plain": LocalEngine(args.target, max_batch_size=args.batch)}
    for name in ("stepping", "chain"):
        engines[name] = LocalEngine(args.target, draft=args.draft, num_speculative_tokens=k, adaptive=adaptive,
                                    max_batch_size=args.batch)
    engines["stepping"].scheduler.draft.drafter._chain_in_c = lambda *_: False
    seconds = {name: [] for name in engines}
    drafting = {name: [] for name in engines}
    groups = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    for engine in engines.values():  # (warm)
        engine.generate(groups[0], [params] * len(groups[0]))
    names = list(engines)
    for rep in range(args.repeats):
        for name in names[rep % 3:] + names[:rep % 3]:
            engine, spent = engines[name], [0.0]
            engine.on_round = lambda report, spent=spent: spent.__setitem__(0, spent[0] + report.draft_seconds)
            start = time.perf_counter()
            for group in groups:
                engine.generate(group, [params] * len(group))
            seconds[name].append(time.perf_counter() - start)
            drafting[name].append(spent[0])
            engine.on_round = None
    tokens = len(prompts) * args.max_new_tokens
    for name in names:
        print(f"{name:9s} {tokens / statistics.median(seconds[name]):7.1f} tok/s, "
              f"in draft calls {statistics.median(drafting[name]) * 1e3:6.0f} ms (medians of {args.repeats})")
    over_stepping = [s / c for s, c in zip(seconds["stepping"], seconds["chain"])]
    over_plain = [p / c for p, c in zip(seconds["plain"], seconds["chain"])]
    print(f"chain / stepping: {statistics.median(over_stepping):.2f}x ({' '.join(f'{r:.2f}' for r in over_stepping)})")
    print(f"chain / plain:    {statistics.median(over_plain):.2f}x ({' '.join(f'{r:.2f}' for r in over_plain)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
