"""`specdec bench-quant`: how close a model held as codes (q8, q4; specdec.model.quantized) stays to
the same model in floats, on held-out prompts.

Quantized weights make another model: speculative decoding reproduces that model's output exactly,
not the float model's. This measures how far apart the two are. For each prompt the float model
writes its greedy continuation; then every format reads the same tokens (teacher forcing) and at
each position we compare: greedy match (the format's top token is the float model's) and
KL(float || format) of the next-token distributions (temperature 1). Also the free-running
agreement: the share of the float model's greedy tokens the format reproduces before its first
different token. With --kv-cache-dtype float16 the formats compared keep a float16 KV cache (the
reference keeps the float model's float32 one): `--formats fp` then measures the cache alone.

  specdec bench-quant                                     # the shipped target, q8 and q4
  specdec bench-quant --target model.gguf --formats auto  # a GGUF's own codes vs its floats
  specdec bench-quant --formats fp q4 --kv-cache-dtype float16   # with a float16 KV cache
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from specdec.config import SHIPPED_TARGET
from specdec.model.batch import prepare_forward
from specdec.model.decoder import load_model
from specdec.role_configs import KV_CACHE_DTYPES
from specdec.tokenizer import load_tokenizer
from specdec_app.bench.prompts import load_prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--target", default=str(SHIPPED_TARGET), help="model (default: the shipped target)")
    parser.add_argument("--formats", nargs="+", default=["q8", "q4"], choices=["auto", "fp", "q8", "q4"],
                        help="weight formats compared with fp (default q8 q4)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="the compared formats' KV cache (default auto: float32, as the reference's)")
    parser.add_argument("--prompts", default=str(SHIPPED_TARGET.parent / "heldout_prompts.jsonl"),
                        help="JSONL prompts (default: the shipped held-out prompts)")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="float model's tokens per prompt (default 64)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")


def logits_along(model, tokens: list[int], count: int) -> torch.Tensor:
    """The model's next-token logits [count, V] at the last `count` positions of `tokens`."""
    cache = model.new_kv_cache(num_blocks=len(tokens) // 16 + 2, block_size=16)
    cache.add_sequence("s")
    return model.forward(prepare_forward(cache, ["s"], [tokens], [count]), cache)


def greedy(model, prompt: list[int], count: int) -> list[int]:
    cache = model.new_kv_cache(num_blocks=(len(prompt) + count) // 16 + 2, block_size=16)
    cache.add_sequence("s")
    out, feed = [], list(prompt)
    for _ in range(count):
        out.append(int(model.forward(prepare_forward(cache, ["s"], [feed], [1]), cache)[0].argmax()))
        feed = [out[-1]]
    return out


def run(args) -> int:
    if min(args.num_prompts, args.max_new_tokens) < 1:
        print("specdec bench-quant: --num-prompts and --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    prompts, _ = load_prompts(args.prompts, args.num_prompts, load_tokenizer(args.target))
    floats = load_model(args.target, weights="fp")
    n = args.max_new_tokens
    continuations = [greedy(floats, p, n) for p in prompts]
    reference = [logits_along(floats, p + c[:-1], n).log_softmax(-1) for p, c in zip(prompts, continuations)]
    rows = {}
    for fmt in args.formats:
        model = load_model(args.target, weights=fmt, kv_cache_dtype=args.kv_cache_dtype)
        matches = kls = total = kept = 0
        for prompt, continuation, ref in zip(prompts, continuations, reference):
            ours = logits_along(model, prompt + continuation[:-1], n).log_softmax(-1)
            matches += int((ours.argmax(-1) == ref.argmax(-1)).sum())
            kls += float((ref.exp() * (ref - ours)).sum(-1).sum())
            total += n
            free = greedy(model, prompt, n)
            kept += next((i for i, (a, b) in enumerate(zip(free, continuation)) if a != b), n)
        rows[fmt] = {"greedy_match": matches / total, "mean_kl": kls / total, "free_running_agreement": kept / total,
                     "weight_bytes": model.weights.nbytes, "positions": total}
    print(f"specdec bench-quant: {args.target}, {len(prompts)} prompts x {n} tokens of the float model's greedy "
          f"output ({floats.weights.nbytes / 1e6:.1f} MB of float weights); compared formats' KV cache "
          f"{args.kv_cache_dtype}")
    print(f"{'format':<7} {'top-1 match':>11} {'mean KL':>9} {'free-running':>13} {'weights MB':>11}")
    for fmt, r in rows.items():
        print(f"{fmt:<7} {r['greedy_match']:>11.3f} {r['mean_kl']:>9.1e} {r['free_running_agreement']:>13.3f} "
              f"{r['weight_bytes'] / 1e6:>11.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"target": args.target, "prompts": len(prompts), "tokens": n,
                                               "kv_cache_dtype": args.kv_cache_dtype, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
