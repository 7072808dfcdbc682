#!/usr/bin/env python
"""Acceptance by position in the draft at a fixed K: P(token k accepted | tokens 1..k-1 accepted).

The policy (coordinator/speculation/speculation_policy.py) prices a request's k-th token at
first * alpha^(k - 1): one rate for every token after the first. Where acceptance differs by
position (easy stretches accept whole drafts), that geometric model misprices long K; this
measures it on a pair and prompt set, batch 1, for greedy and a temperature:

    .venv/bin/python scripts/acceptance_by_position.py --prompts models/heldout_prompts.jsonl
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec import LocalEngine, SamplingParams  # noqa: E402
from specdec.config import SHIPPED_DRAFT, SHIPPED_TARGET  # noqa: E402
from specdec.tokenizer import load_tokenizer  # noqa: E402
from specdec_app.bench.prompts import load_prompts  # noqa: E402


def by_position(target: str, draft: str, prompts: list[list[int]], k: int, params: SamplingParams,
                **settings) -> tuple[list[tuple[int, int]], dict[bool, tuple[int, int]]]:
    """(accepted, tested) at each position 1..k over every round of the prompts, one at a time, and
    the first position's apart by whether the request's round before rejected a token (the
    policy's `first` rate: True) or not (settings: more of the service's, as LocalEngine takes them)."""
    hits, tested, missed = collections.Counter(), collections.Counter(), {}
    first = {True: [0, 0], False: [0, 0]}  # after a miss: [accepted, tested]

    def on_round(report) -> None:
        for update in report.updates:
            if update.proposed:
                after_miss = missed.get(update.req_id, False)
                first[after_miss][0] += update.accepted >= 1
                first[after_miss][1] += 1
                missed[update.req_id] = update.accepted < update.proposed
            for position in range(1, update.proposed + 1):
                if update.accepted >= position - 1:  # (tested: every token before it accepted)
                    tested[position] += 1
                    hits[position] += update.accepted >= position

    engine = LocalEngine(target, draft, adaptive=False, num_speculative_tokens=k, on_round=on_round, **settings)
    for prompt in prompts:
        engine.generate([prompt], params)
    return [(hits[p], tested[p]) for p in range(1, k + 1)], {m: (a, t) for m, (a, t) in first.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(SHIPPED_TARGET))
    parser.add_argument("--draft", default=str(SHIPPED_DRAFT))
    parser.add_argument("--prompts", default="models/heldout_prompts.jsonl")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--temperatures", default="0,0.8")
    args = parser.parse_args()
    prompts = load_prompts(args.prompts, args.num_prompts, load_tokenizer(args.target))[0]
    for temperature in map(float, args.temperatures.split(",")):
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=temperature, ignore_eos=True)
        counts, first = by_position(args.target, args.draft, prompts, args.k, params)
        rates = " ".join(f"{h / max(t, 1):.2f}" for h, t in counts)
        split = ", ".join(f"{'after a miss' if miss else 'otherwise'} {a / max(t, 1):.2f} ({t})"
                          for miss, (a, t) in first.items())
        print(f"T={temperature}: acceptance by position {rates} (tested {' '.join(str(t) for _, t in counts)}); "
              f"the first: {split}")


if __name__ == "__main__":
    main()
