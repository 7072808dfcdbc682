"""`specdec bench`: tokens/s of specdec (plain, draft model, n-gram) vs Hugging Face `generate`
(plain and assisted), greedy and sampled, at several batch sizes, in one run.

Prints a table (tokens/s, ratios, acceptance, mean accepted length, cost ratio c, expected
speedup), the step-cost measurement, where specdec's time went, and the four project targets;
writes bench.json and bench.png under --out. `--sweep-k` adds a speedup-vs-K sweep.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from specdec.app.flags import add_settings, format_default, given_settings
from specdec.config import NGRAM, REPO_ROOT, SHIPPED_DRAFT, ConfigError, ServiceConfig, WorkerConfig
from specdec.kv_cache import blocks_for_tokens

ALL_SYSTEMS = ["engine", "spec-draft", "spec-ngram", "hf", "hf-assisted"]
DEFAULT_SWEEP = "1,2,3,4,6,8"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not (v >= 0 and math.isfinite(v)) for v in values):
        raise argparse.ArgumentTypeError(f"temperatures must be finite and >= 0, got {text!r}")
    return values


def _systems(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in ALL_SYSTEMS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown system(s) {bad}; choose from {','.join(ALL_SYSTEMS)}")
    return [s for s in ALL_SYSTEMS if s in names]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    add_settings(parser, ["target"])
    parser.add_argument("--draft", default=str(SHIPPED_DRAFT),
                        help="draft checkpoint dir of the spec-draft system "
                             f"(default: {format_default(str(SHIPPED_DRAFT))})")
    parser.add_argument("--prompts", default="models/heldout_prompts.jsonl",
                        help='JSONL, one {"prompt": text} or {"prompt_ids": [ids]} per line '
                             "(default: the held-out prompts)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="prompts per run, spread over the file (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens generated per prompt (default 128)")
    add_settings(parser, ["num_speculative_tokens"])
    parser.add_argument("--batch-sizes", type=_int_list, default=None, help="comma-separated (default 1,8)")
    parser.add_argument("--temperatures", type=_float_list, default=[0.0, 0.8],
                        help="comma-separated; 0 = greedy (default 0,0.8)")
    parser.add_argument("--systems", type=_systems, default=list(ALL_SYSTEMS),
                        help=f"subset of {','.join(ALL_SYSTEMS)} (default: all)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads for every system (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="base seed of sampled requests")
    parser.add_argument("--sweep-k", nargs="?", const=DEFAULT_SWEEP, default=None, metavar="K1,K2,...",
                        help="also sweep K for the speculative systems at batch 1 greedy "
                             f"(default list {DEFAULT_SWEEP})")
    parser.add_argument("--sweep-only", action="store_true", help="with --sweep-k: skip the main grid")
    parser.add_argument("--cost-steps", type=int, default=None,
                        help="timed passes per step-cost measurement (default 30)")
    parser.add_argument("--out", default="bench_out", help="output folder for bench.json and bench.png")
    parser.add_argument("--quick", action="store_true",
                        help="tiny smoke run: 2 prompts, 16 new tokens, batch sizes 1,2")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _resolve(path: str) -> str:
    """Relative paths are tried from the working directory, then from the repository."""
    p = Path(path)
    if p.is_absolute() or p.exists() or path == NGRAM:
        return str(p)
    alt = REPO_ROOT / p
    return str(alt) if alt.exists() else str(p)


def _environment(args, param_counts: dict) -> dict:
    import torch
    import transformers

    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = None
    try:
        import subprocess

        commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
    except Exception:
        pass
    return {
        "python": platform.python_version(), "platform": platform.platform(), "cpu": cpu,
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(), "git_commit": commit,
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "parameters": param_counts,
    }


def _kv_blocks(prompts: list[list[int]], max_new: int, max_k: int, max_batch: int) -> int:
    """Room for a full batch of the longest prompt plus its output and draft tokens."""
    tokens = max(len(p) for p in prompts) + max_new + max_k + 2
    return max_batch * (blocks_for_tokens(tokens, WorkerConfig().kv_block_size) + 2) + 8


def run(args) -> int:
    import torch
    from tqdm import tqdm

    from specdec.app.bench import report
    from specdec.app.bench.runners import (
        SYSTEMS,
        EngineSystem,
        HFSystem,
        Mode,
        load_hf,
        load_prompts,
        measure_step_costs,
    )
    from specdec.tokenizer import load_tokenizer

    quick = args.quick
    num_prompts = args.num_prompts or (2 if quick else 8)
    max_new = args.max_new_tokens or (16 if quick else 128)
    batch_sizes = args.batch_sizes or ([1, 2] if quick else [1, 8])
    cost_steps = args.cost_steps or (5 if quick else 30)
    try:
        config = ServiceConfig.from_settings(**given_settings(args, ["target", "num_speculative_tokens"]))
    except ConfigError as e:
        print(f"specdec bench: {e}", file=sys.stderr)
        return 2
    k = config.scheduler.num_speculative_tokens
    sweep_ks = _int_list(args.sweep_k) if args.sweep_k else []
    if args.sweep_only and not sweep_ks:
        print("specdec bench: --sweep-only needs --sweep-k", file=sys.stderr)
        return 2
    if num_prompts < 1 or max_new < 1 or k < 1 or args.threads < 1:
        print("specdec bench: --num-prompts, --max-new-tokens, -k and --threads must be >= 1", file=sys.stderr)
        return 2
    modes = [Mode("greedy" if t == 0 else f"T={t:g}", t) for t in args.temperatures]
    systems = list(args.systems)
    torch.set_num_threads(args.threads)
    target, draft, prompts_path = _resolve(config.target.model), _resolve(args.draft), _resolve(args.prompts)
    needs_draft = any(SYSTEMS[s][1] for s in systems)
    for what, path in [("target", target), ("prompts", prompts_path)] + ([("draft", draft)] if needs_draft else []):
        if not Path(path).exists():
            print(f"specdec bench: {what} {path!r} does not exist"
                  + (" (train the pair with scripts/train_pair.py)" if what != "prompts" else ""), file=sys.stderr)
            return 2
    out_dir = Path(args.out)
    show = not args.no_progress

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 0.5 * (os.cpu_count() or 1):
        log(f"warning: load average {load:.1f} on {os.cpu_count()} CPUs before starting: other work is running, "
            "so timings will be noisy (and threads > free cores can be many times slower)")
    prompts, prompt_names = load_prompts(prompts_path, num_prompts, load_tokenizer(target))
    kv_blocks = _kv_blocks(prompts, max_new, max([k] + sweep_ks), max(batch_sizes))
    log(f"specdec bench: {len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
        f"{max_new} new tokens each, K={k}, batch sizes {batch_sizes}, {args.threads} threads")

    # -- load every system once ----------------------------------------------------------------
    t0 = time.perf_counter()
    built: dict = {}
    hf_target = None
    for key in tqdm(systems, desc="loading", disable=not show, leave=False):
        if key == "engine":
            built[key] = EngineSystem(key, target, None, k, kv_blocks, max(batch_sizes))
        elif key == "spec-draft":
            built[key] = EngineSystem(key, target, draft, k, kv_blocks, max(batch_sizes))
        elif key == "spec-ngram":
            built[key] = EngineSystem(key, target, NGRAM, k, kv_blocks, max(batch_sizes))
        else:
            hf_target = hf_target if hf_target is not None else load_hf(target)
            built[key] = HFSystem(key, target, draft if key == "hf-assisted" else None, k, model=hf_target)
    log(f"loaded {len(built)} systems in {time.perf_counter() - t0:.1f}s")

    from specdec.model.llama import LlamaModel

    params = {"target": LlamaModel.load(target).num_parameters}
    if needs_draft:
        params["draft"] = LlamaModel.load(draft).num_parameters
    env = _environment(args, params)

    # -- cost ratio c ------------------------------------------------------------------------------
    costs = None
    if any(s in systems for s in ("spec-draft", "spec-ngram")):
        log("measuring draft/target step costs ...")
        has_draft = Path(draft).exists() and draft != NGRAM
        costs = measure_step_costs(target, draft if has_draft else None, prompts, batch_sizes, k, cost_steps,
                                   kv_cache_blocks=kv_blocks)

    # -- main grid -----------------------------------------------------------------------------------
    results = []
    combos = [] if args.sweep_only else [(m, b, s) for m in modes for b in batch_sizes for s in systems]
    total_tokens = sum(max_new * num_prompts for m, b, s in combos if not (SYSTEMS[s][2] and b != 1))
    overall = tqdm(total=total_tokens, desc="bench", unit="tok", disable=not show, position=0)
    try:
        for mode, batch, key in combos:
            system = built[key]
            overall.set_postfix_str(f"{key} b{batch} {mode.name}")
            system.warm_up(prompts, batch, mode, args.seed)
            results.append(system.run(prompts, batch, mode, max_new, args.seed, bar=overall))
    finally:
        overall.close()

    # -- K sweep -------------------------------------------------------------------------------------
    sweep = []
    sweep_baseline = []
    sweep_systems = [s for s in ("spec-draft", "spec-ngram") if s in systems]
    if sweep_ks and sweep_systems:
        greedy = modes[0] if modes[0].greedy else Mode("greedy", 0.0)
        base = [r for r in results if r.system == "engine" and r.batch == 1 and r.mode == greedy.name]
        if not base:
            plain = built.get("engine") or EngineSystem("engine", target, None, k, kv_blocks, max(batch_sizes))
            plain.warm_up(prompts, 1, greedy, args.seed)
            base = [plain.run(prompts, 1, greedy, max_new, args.seed)]
        sweep_baseline = base
        bar = tqdm(total=len(sweep_ks) * len(sweep_systems) * max_new * num_prompts, desc="sweep K", unit="tok",
                   disable=not show)
        try:
            for key in sweep_systems:
                for sk in sweep_ks:
                    bar.set_postfix_str(f"{key} K={sk}")
                    built[key].warm_up(prompts, 1, greedy, args.seed, k=sk)
                    sweep.append(built[key].run(prompts, 1, greedy, max_new, args.seed, k=sk, bar=bar))
        finally:
            bar.close()
        report.annotate(sweep, costs, baselines=sweep_baseline)

    report.annotate(results, costs)
    targets = report.evaluate_targets(results)

    # -- report --------------------------------------------------------------------------------------
    print()
    if results:
        print(f"tokens/s on {len(prompts)} held-out prompts x {max_new} new tokens (K={k}, {args.threads} threads, "
              f"{os.cpu_count()} CPUs); x plain / x HF / x HF-asst = tok/s ratio to specdec plain / HF generate / "
              f"HF assisted at the same batch and mode; accept = accepted/proposed; alpha = accepted/tested "
              f"(per-token, what the formula assumes); "
              f"theory x = (1-a^(K+1))/((1-a)(Kc+1)) with a = alpha; "
              f"=plain: greedy outputs identical to specdec plain's")
        print(report.format_table(results))
        print()
    if sweep:
        print("K sweep (batch 1, greedy; x plain vs specdec plain "
              f"{sweep_baseline[0].tokens_per_s:.1f} tok/s):")
        print(report.format_table(sweep))
        print()
    print(report.format_costs(costs))
    print()
    if results:
        print(report.format_breakdown(results))
        print()
        print(report.format_targets(targets))
        hf_assisted_skipped = any(r.skipped for r in results if r.system == "hf-assisted")
        if hf_assisted_skipped:
            print("note: HF assisted generation supports batch size 1 only; its batch > 1 rows are n/a")

    payload = {
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "arguments": {k_: v for k_, v in vars(args).items() if k_ != "func"},
        "config": {"target": target, "draft": draft, "prompts_file": prompts_path, "num_prompts": len(prompts),
                   "prompt_sources": prompt_names, "prompt_lengths": [len(p) for p in prompts],
                   "max_new_tokens": max_new, "num_speculative_tokens": k, "batch_sizes": batch_sizes,
                   "modes": [{"name": m.name, "temperature": m.temperature} for m in modes],
                   "systems": systems, "seed": args.seed, "threads": args.threads, "kv_cache_blocks": kv_blocks,
                   "hf_assisted": {"num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant",
                                   "note": "batch size 1 only"},
                   "eos": "ignored: specdec ignore_eos=True, HF min_new_tokens=max_new_tokens"},
        "environment": env,
        "cost": costs,
        "results": [r.to_json() for r in results],
        "sweep": [r.to_json() for r in sweep],
        "sweep_baseline": [r.to_json() for r in sweep_baseline],
        "targets": targets,
    }
    env["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    json_path, png_path = out_dir / "bench.json", out_dir / "bench.png"
    report.write_json(json_path, payload)
    title = (f"specdec bench: {len(prompts)} prompts x {max_new} tokens, K={k}, {args.threads} threads, "
             f"target {params['target'] / 1e6:.1f}M"
             + (f", draft {params['draft'] / 1e6:.1f}M" if "draft" in params else ""))
    report.write_plot(png_path, results, sweep, title)
    print(f"\nwrote {json_path} and {png_path}")
    return 0
