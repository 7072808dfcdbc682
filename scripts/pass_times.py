#!/usr/bin/env python
"""Milliseconds of single forward passes of the shipped pair, for A/B runs between commits.

    PYTHONPATH=<checkout> python scripts/pass_times.py <checkout>   # one JSON line per run
    PYTHONPATH=<checkout> python scripts/pass_times.py <checkout> MODEL ...   # other models (a GGUF file)
    ... --kv-cache-dtype float16   # the models' KV caches in float16 (load_model's kv_cache_dtype)

Passes (batch x new tokens) of 1 x 1, 1 x 6, 8 x 1 and 8 x 6 over a 200-token context, and a
300-token prompt, for the target and the draft; each the best of 3 x 30 passes (3 x 3 for the
prompt), 2 threads. Run two checkouts alternately, several times each, and compare medians
(docs/bench-2026-11-26.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e3


def model_times(path: str, kv_cache_dtype: str) -> dict:
    from specdec.model.batch import prepare_forward
    from specdec.model.decoder import load_model

    model = load_model(path, kv_cache_dtype=kv_cache_dtype)
    cache = model.new_kv_cache(1024, 16)
    seqs = [f"s{i}" for i in range(8)]
    for seq in seqs + ["prompt"]:
        cache.add_sequence(seq)
    model.forward(prepare_forward(cache, seqs, [[5] * 200] * 8, [1] * 8), cache)

    def run(batch: int, new: int):
        def once():
            model.forward(prepare_forward(cache, seqs[:batch], [[7] * new] * batch, [new] * batch), cache)
            for seq in seqs[:batch]:
                cache.truncate_to(seq, 200)
        return once

    def prompt():
        model.forward(prepare_forward(cache, ["prompt"], [[9] * 300], [1]), cache)
        cache.truncate_to("prompt", 0)

    times = {f"b{batch} x{new}": best_ms(run(batch, new), 30) for batch in (1, 8) for new in (1, 6)}
    times["prompt300"] = best_ms(prompt, 3)
    return times


def main(root: str, models: list[str], kv_cache_dtype: str = "auto") -> dict:
    sys.path.insert(0, root)  # the checkout measured, whatever is installed
    torch.set_num_threads(2)
    named = {os.path.basename(m): m for m in models} or {
        name: os.path.join(root, "models", name) for name in ("target", "draft")}
    return {f"{name} {k}": v for name, path in named.items() for k, v in model_times(path, kv_cache_dtype).items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", nargs="?", default=".")
    parser.add_argument("models", nargs="*")
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    print(json.dumps(main(args.checkout, args.models, args.kv_cache_dtype)))
