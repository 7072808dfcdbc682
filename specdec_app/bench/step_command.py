"""`specdec bench-step`: decode speed against the physical floor and against Hugging Face, on a model
of a real shape (SmolLM2-135M by default, random weights, built once and cached), in one run.

Measures, all in the same process and run: the floor of a batch-1 decode step (weight bytes read per
step / bandwidth of one large matrix-vector product, specdec_app.bench.floor); specdec's decode step
at batch 1 and 8 (ratio to the floor beside it), and at batch 1 through torch's ops instead of its C
kernels (specdec.model.cpu_kernels), for comparison; plain `generate` ms/token of specdec and of Hugging
Face transformers at batch 1 and 8 (median of --runs runs); and the n-gram drafter vs plain
decoding on a copy-heavy chat prompt ("rewrite this paragraph with one word changed").
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

from specdec.config import NGRAM, ServiceConfig, WorkerConfig
from specdec.model.runner import ModelRunner
from specdec.tokenizer import load_tokenizer, render_chat
from specdec_app.bench.engine_runner import EngineSystem
from specdec_app.bench.floor import MATVEC_SHAPE, MatvecProbe, time_decode_steps
from specdec_app.bench.hf_runner import HFSystem, load_hf
from specdec_app.bench.results import Mode
from specdec_app.bench.shapes import COPY_ANSWER, COPY_PROMPT, SHAPES, build_copy_checkpoint, copy_messages

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec" / "bench-models"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m",
                        help="shape of the random checkpoint to build (default smollm2-135m)")
    parser.add_argument("--target", default=None,
                        help="measure this checkpoint (directory, .gguf or Hub id) instead of a built one; "
                             "its chat template renders the copy prompt (plain text without one)")
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE),
                        help=f"where built checkpoints are kept and reused (default {DEFAULT_CACHE})")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--runs", type=int, default=None,
                        help="timed runs per generate measurement, median reported (default 3); the systems "
                             "compared take turns")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="tokens per plain generate run (default 64)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps per batch size (default 20)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--cpu-kernels", action=argparse.BooleanOptionalAction, default=True,
                        help="run specdec with its C kernels (default; the batch-1 step is also timed through "
                             "torch's ops beside them); --no-cpu-kernels: torch's ops throughout")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny shape, 1 run, 8 new tokens, 3 steps")


def _load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _side_by_side(systems: dict, prompts, batch, mode, max_new, runs) -> dict:
    """{name: (median ms per generated token over `runs`, the last run's result)} for each system,
    the runs interleaved (a, b, a, b, ...) so that a shared machine's load hits all of them alike."""
    for system in systems.values():
        system.warm_up(prompts, batch, mode, seed=0)
    times: dict = {name: [] for name in systems}
    last: dict = {}
    for _ in range(runs):
        for name, system in systems.items():
            last[name] = system.run(prompts, batch, mode, max_new, seed=0)
            times[name].append(1e3 / last[name].tokens_per_s)
    return {name: (statistics.median(times[name]), last[name]) for name in systems}


def run(args) -> int:
    quick = args.quick
    shape = "tiny" if quick and args.target is None else args.shape
    runs = args.runs or (1 if quick else 3)
    max_new = args.max_new_tokens or (8 if quick else 64)
    steps = args.steps or (3 if quick else 20)
    if min(runs, max_new, steps, args.threads) < 1:
        print("specdec bench-step: --runs, --max-new-tokens, --steps and --threads must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    load_at_start = _load_average()
    started = time.perf_counter()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if load_at_start and load_at_start[0] > 0.5 * (os.cpu_count() or 1):
        log(f"warning: load average {load_at_start[0]:.1f} on {os.cpu_count()} CPUs before starting: other work is "
            "running, so timings will be noisy; with more threads than free cores every parallel op can stall "
            "for a scheduler slice (--threads 1 is steadier then)")
    if args.target is None:
        log(f"building or reusing the {shape} checkpoint under {args.cache_dir} ...")
        target = str(build_copy_checkpoint(shape, Path(args.cache_dir)))
        what = f"random {shape}-shaped checkpoint (copy answer planted)"
    else:
        target, what = args.target, args.target
    tokenizer = load_tokenizer(target)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        prompt = render_chat(tokenizer, copy_messages())
    elif tokenizer is not None:
        prompt = list(tokenizer(COPY_PROMPT + "\n\n")["input_ids"])
    else:
        print(f"specdec bench-step: {target} has no tokenizer", file=sys.stderr)
        return 2
    # The planted answer's length: the n-gram run then times the copy itself (a real model decides).
    answer = list(tokenizer(COPY_ANSWER, add_special_tokens=False)["input_ids"])
    copy_tokens = len(answer) if args.target is None else max_new
    copy_tokens = min(copy_tokens, max_new) if quick else copy_tokens
    k = ServiceConfig().scheduler.num_speculative_tokens
    kv_blocks = 8 * ((len(prompt) + max(max_new, copy_tokens) + k + 2) // 16 + 3) + 8

    # -- floor and decode steps ----------------------------------------------------------------
    log("timing decode steps against the matvec probe ...")
    runner = ModelRunner.load(WorkerConfig(kv_cache_blocks=kv_blocks, cpu_kernels=args.cpu_kernels), target)
    probe = MatvecProbe()
    step = {b: time_decode_steps(runner, prompt, b, steps, probe) for b in (1, 8)}
    kernels, torch_step = runner.model.kernels, None
    # The same weights and cache through torch's ops, for comparison (codes have no torch path).
    if kernels is not None and not runner.model.quantized:
        runner.model.kernels = None
        torch_step = time_decode_steps(runner, prompt, 1, steps, probe)
        runner.model.kernels = kernels
    config = runner.model.config
    held_as = "weights as codes (q8/q4), float32 activations" if runner.model.quantized else "float32"
    del runner

    # -- plain generate: specdec vs Hugging Face -------------------------------------------------
    greedy = Mode("greedy", 0.0)
    log("plain generate: specdec and Hugging Face at batch 1 and 8 ...")
    plain = EngineSystem("engine", target, None, k, kv_blocks, 8, cpu_kernels=args.cpu_kernels)
    hf = HFSystem("hf", target, None, k, model=load_hf(target))
    generate: dict = {}
    for batch in (1, 8):
        measured = _side_by_side({"specdec": plain, "hf": hf}, [prompt] * batch, batch, greedy, max_new, runs)
        generate[batch] = {"specdec_ms_per_token": measured["specdec"][0], "hf_ms_per_token": measured["hf"][0]}
    del hf

    # -- n-gram drafter on the copy-heavy chat prompt ----------------------------------------------
    log("n-gram drafter vs plain on the copy prompt ...")
    ngram = EngineSystem("spec-ngram", target, NGRAM, k, kv_blocks, 8, cpu_kernels=args.cpu_kernels)
    measured = _side_by_side({"plain": plain, "ngram": ngram}, [prompt], 1, greedy, copy_tokens, runs)
    (plain_ms, plain_result), (ngram_ms, ngram_result) = measured["plain"], measured["ngram"]
    same = plain_result.outputs == ngram_result.outputs
    copied = plain_result.outputs[0] == answer[:copy_tokens]  # the model rewrote the paragraph
    load_at_end = _load_average()

    # -- report ---------------------------------------------------------------------------------------
    s1, s8 = step[1], step[8]
    shape_text = (f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, intermediate "
                  f"{config.intermediate_size}, {config.num_attention_heads}/{config.num_key_value_heads} heads, "
                  f"vocab {config.vocab_size}")
    print(f"specdec bench-step: {what} ({shape_text}), {held_as}, {args.threads} threads, {os.cpu_count()} CPUs")
    print(f"load average (1, 5, 15 min): {load_at_start} at start")
    print(f"floor: {s1.weight_bytes / 1e6:.1f} MB of weights per decode step / {s1.bandwidth / 1e9:.1f} GB/s "
          f"(one [{MATVEC_SHAPE[0]} x {MATVEC_SHAPE[1]}] matvec, between the steps) "
          f"= {s1.floor_s * 1e3:.1f} ms")
    print(f"decode step, context {s1.context_len} tokens, median of {steps}: batch 1 {s1.step_s * 1e3:.1f} ms "
          f"= {s1.over_floor:.2f}x floor (min {s1.min_step_s * 1e3:.1f} ms); batch 8 {s8.step_s * 1e3:.1f} ms "
          f"({s8.step_s / 8 * 1e3:.1f} ms/token) = {s8.over_floor:.2f}x floor")
    if torch_step is not None:
        relative = s1.over_floor / torch_step.over_floor  # of ratios: the two are timed one after the other
        print(f"  batch 1 through torch's ops instead of the C kernels: {torch_step.step_s * 1e3:.1f} ms = "
              f"{torch_step.over_floor:.2f}x floor (the C kernels' ratio to the floor is {relative:.2f}x this one)")
    elif kernels is not None:
        print("  (weights held as codes: no torch path to compare with)")
    else:
        print(f"  C kernels: {'off (--no-cpu-kernels)' if not args.cpu_kernels else 'unavailable (see the warning)'}")
    print(f"plain generate, {max_new} new tokens, median of {runs} (ms/token):")
    for batch, g in generate.items():
        print(f"  batch {batch}: specdec {g['specdec_ms_per_token']:.1f}, HF {g['hf_ms_per_token']:.1f} "
              f"(specdec {g['hf_ms_per_token'] / g['specdec_ms_per_token']:.2f}x HF's speed)")
    print(f"n-gram drafter (K <= {k}, adaptive) on the copy-heavy chat prompt, batch 1, {copy_tokens} new tokens, "
          f"median of {runs}: plain {plain_ms:.1f} ms/token, n-gram {ngram_ms:.1f} ms/token = "
          f"{plain_ms / ngram_ms:.2f}x plain (acceptance {ngram_result.acceptance_rate or 0:.2f}, "
          f"{ngram_result.mean_accepted_length:.2f} tokens per target pass; same output as plain: {same}; "
          f"output is the rewritten paragraph: {copied})")
    print(f"load average (1, 5, 15 min): {load_at_end} at end; {time.perf_counter() - started:.0f} s")
    if args.json:
        payload = {
            "target": target, "shape": shape if args.target is None else None, "threads": args.threads,
            "runs": runs, "max_new_tokens": max_new, "copy_tokens": copy_tokens, "prompt_tokens": len(prompt),
            "load_average_at_start": load_at_start, "load_average_at_end": load_at_end,
            "weight_bytes": s1.weight_bytes, "matvec_bandwidth_bytes_per_s": s1.bandwidth, "floor_ms": s1.floor_s * 1e3,
            "step": {str(b): {"step_ms": t.step_s * 1e3, "min_step_ms": t.min_step_s * 1e3,
                              "over_floor": t.over_floor, "floor_ms": t.floor_s * 1e3} for b, t in step.items()},
            "cpu_kernels": kernels is not None,
            "torch_ops_step_1": None if torch_step is None else {"step_ms": torch_step.step_s * 1e3,
                                                                 "over_floor": torch_step.over_floor},
            "generate": {str(b): g for b, g in generate.items()},
            "ngram_copy": {"plain_ms_per_token": plain_ms, "ngram_ms_per_token": ngram_ms,
                           "speedup": plain_ms / ngram_ms, "acceptance_rate": ngram_result.acceptance_rate,
                           "mean_accepted_length": ngram_result.mean_accepted_length, "same_output": same,
                           "output_is_rewritten_paragraph": copied},
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
