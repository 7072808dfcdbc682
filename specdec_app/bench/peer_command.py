"""`specdec bench-peer`: specdec beside llama.cpp on the same quantized GGUF files, in one run.

The model is bench-step's random SmolLM2-135M-shaped checkpoint with its planted copy answer
(specdec_app.bench.shapes), written as a GGUF of each --types (Q4_1 and Q8_0 by default: llama.cpp's
own formats, which specdec holds as the same codes), built once and cached. On the copy-heavy chat
prompt ("rewrite this paragraph with one word changed") it measures, greedy, the systems taking
turns run by run: plain decoding at batch 1 for both, specdec's batch 8 (total tokens/s), and each
one's prompt lookup (specdec's n-gram drafter, adaptive K; llama.cpp's LlamaPromptLookupDecoding
at 2 and 10 tokens, its best taken). Also specdec's resident weight bytes against the file's size.
Both keep their KV caches in float16 by default, llama.cpp's default (--kv-cache-dtype auto gives
specdec the model's float32 cache).
llama.cpp runs through llama-cpp-python where it is installed (`pip install llama-cpp-python`, an
optional extra); without it specdec's rows are still measured, and likewise where llama.cpp dies
decoding a few tokens in a child process first (its rows then say why).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from specdec.config import NGRAM
from specdec.model.decoder import load_model
from specdec.role_configs import KV_CACHE_DTYPES
from specdec.tokenizer import load_tokenizer, render_chat
from specdec_app.bench.engine_runner import kv_blocks_for
from specdec_app.bench.peer_runner import LlamaCppSystem, SpecdecSystem, llama_cpp_failure, llama_cpp_version
from specdec_app.bench.shapes import COPY_ANSWER, SHAPE_VERSION, SHAPES, build_copy_checkpoint, copy_messages
from specdec_app.bench.step_command import DEFAULT_CACHE

LOOKUP_TOKENS = (2, 10)  # llama.cpp prompt-lookup lengths tried; the faster counts
WRITABLE_TYPES = ("F32", "F16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")  # gguf.quants can write these


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--types", nargs="+", default=["Q4_1", "Q8_0"], choices=WRITABLE_TYPES,
                        help="GGUF tensor types, which the gguf package can write (default Q4_1 Q8_0)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m", help="model shape")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per system, median reported (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per plain run (default 64)")
    parser.add_argument("--threads", type=int, default=2, help="threads for both (default 2)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="float16",
                        help="specdec's KV cache (default float16: what llama.cpp's cache holds by default; auto: "
                             "the model's float32)")
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help=f"built models (default {DEFAULT_CACHE})")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny shape, 1 run, 8 tokens")


def gguf_of(checkpoint: Path, tensor_type: str) -> Path:
    """The checkpoint as a GGUF of tensor_type, next to it (built once)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec_app.bench.gguf_export import export_gguf, quantizing_store

    path = checkpoint.with_name(f"{checkpoint.name}-{tensor_type}.gguf")
    if not path.exists():
        partial = path.with_suffix(".partial")
        model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        export_gguf(model, partial, quantizing_store(tensor_type), tokenizer, tokenizer.chat_template, pre="default")
        partial.rename(path)
    return path


def _medians(systems: dict, prompt: list[int], runs: int) -> dict:
    """{name: {"request": median request tokens/s, "decode": median decode tokens/s, "output": the
    last run's first output}}, for systems {name: (system, batch, tokens)}, taking turns run by run."""
    results: dict = {name: [] for name in systems}
    for _ in range(runs):
        for name, (system, batch, tokens) in systems.items():
            results[name].append(system.run([prompt] * batch, tokens))
    return {name: {"request": statistics.median(r.request_tokens_per_s for r in rs),
                   "decode": statistics.median(r.decode_tokens_per_s for r in rs), "output": rs[-1].outputs[0]}
            for name, rs in results.items()}


def measure(path: Path, prompt: list[int], answer: list[int], args, log) -> dict:
    max_new, copy_tokens = args.max_new_tokens, min(len(answer), 4 * args.max_new_tokens)
    blocks = kv_blocks_for([prompt], max(max_new, copy_tokens), 8, 8)
    plain = SpecdecSystem(str(path), None, blocks, 8, args.kv_cache_dtype)
    ngram = SpecdecSystem(str(path), NGRAM, blocks, 8, args.kv_cache_dtype)
    for system, batch in ((plain, 1), (plain, 8), (ngram, 1)):
        system.warm_up([prompt] * batch)
    systems = {"specdec b1": (plain, 1, max_new), "specdec b8": (plain, 8, max_new)}
    copy_systems = {"specdec n-gram": (ngram, 1, copy_tokens), "specdec plain": (plain, 1, copy_tokens)}
    version = llama_cpp_version()
    failure = None if version is None else llama_cpp_failure(str(path), args.threads)
    if failure:
        log(f"{path.name}: llama.cpp's rows skipped: {failure}")
    elif version is not None:
        context = len(prompt) + max(max_new, copy_tokens) + 16
        for lookup in (0, *LOOKUP_TOKENS):
            peer = LlamaCppSystem(str(path), args.threads, context, lookup)
            peer.warm_up([prompt])
            if lookup == 0:
                systems["llama.cpp"] = (peer, 1, max_new)
            copy_systems[f"llama.cpp lookup {lookup}" if lookup else "llama.cpp plain"] = (peer, 1, copy_tokens)
    log(f"{path.name}: plain decoding ...")
    measured = _medians(systems, prompt, args.runs)
    log(f"{path.name}: prompt lookup on the copy prompt ...")
    measured.update(_medians(copy_systems, prompt, args.runs))
    same = measured["specdec n-gram"].pop("output") == measured["specdec plain"]["output"]
    for row in measured.values():
        row.pop("output", None)
    return {"rates": measured, "file_bytes": path.stat().st_size, "weight_bytes": load_model(str(path)).weights.nbytes,
            "llama_cpp": version, "llama_cpp_failure": failure, "copy_tokens": copy_tokens, "ngram_same_as_plain": same}


def run(args) -> int:
    if min(args.runs, args.max_new_tokens, args.threads) < 1:
        print("specdec bench-peer: --runs, --max-new-tokens and --threads must be >= 1", file=sys.stderr)
        return 2
    if args.quick:
        args.shape, args.runs, args.max_new_tokens = "tiny", 1, 8
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    log(f"building or reusing the {args.shape} checkpoint and its GGUF files under {args.cache_dir} ...")
    checkpoint = build_copy_checkpoint(args.shape, Path(args.cache_dir))
    tokenizer = load_tokenizer(str(checkpoint))
    prompt = render_chat(tokenizer, copy_messages())
    answer = list(tokenizer(COPY_ANSWER, add_special_tokens=False)["input_ids"])
    rows = {}
    for tensor_type in args.types:
        rows[tensor_type] = measure(gguf_of(checkpoint, tensor_type), prompt, answer, args, log)
    version = llama_cpp_version()
    print(f"specdec bench-peer: random {args.shape}-shaped checkpoint (copy answer planted, v{SHAPE_VERSION}), "
          f"greedy, {args.threads} threads, {os.cpu_count()} CPUs, median of {args.runs}, specdec's KV cache "
          f"{args.kv_cache_dtype}; "
          f"llama.cpp: {'llama-cpp-python ' + version if version else 'not installed (pip install llama-cpp-python)'}")
    for tensor_type, r in rows.items():
        held, file, rates = r["weight_bytes"], r["file_bytes"], r["rates"]
        print(f"{tensor_type}: weights held {held / 1e6:.1f} MB = {held / file:.2f}x the file ({file / 1e6:.1f} MB)")
        if r["llama_cpp_failure"]:
            print(f"  llama.cpp not measured: {r['llama_cpp_failure']}")
        print(f"  {'system':<24} {'decode tok/s':>12} {'request tok/s':>14}   (decode: after the first token; "
              "request: prompt included)")
        for name, rate in rates.items():
            print(f"  {name:<24} {rate['decode']:>12.1f} {rate['request']:>14.1f}")
        b1, b8 = rates["specdec b1"]["decode"], rates["specdec b8"]["decode"]
        line = f"  plain: specdec b8 {b8 / b1:.2f}x its b1"
        if "llama.cpp" in rates:
            line += f"; specdec b1 {b1 / rates['llama.cpp']['decode']:.2f}x llama.cpp's (decode)"
            best = max((n for n in rates if n.startswith("llama.cpp ")), key=lambda n: rates[n]["decode"])
            line += (f"; copy prompt ({r['copy_tokens']} tokens): specdec n-gram "
                     f"{rates['specdec n-gram']['decode'] / rates[best]['decode']:.2f}x llama.cpp's best ({best})")
        ngram = rates["specdec n-gram"]["decode"] / rates["specdec plain"]["decode"]
        print(line + f"; specdec n-gram {ngram:.2f}x its plain, same output: {r['ngram_same_as_plain']}")
    print(f"{time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "runs": args.runs, "threads": args.threads,
                                               "max_new_tokens": args.max_new_tokens,
                                               "kv_cache_dtype": args.kv_cache_dtype, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
