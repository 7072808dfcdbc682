"""`specdec bench-policy`: the adaptive speculation policy against its oracle, on a family of pairs.

For every pair and row (batch size x greedy / T=0.8) it runs specdec plain, specdec adaptive and
specdec at every fixed K from 1 to K_max, side by side, and prints the adaptive row's ratio to the
best of them ("the oracle": what a user who measured every K on this traffic would pick) and to
plain. The pairs span acceptance from ~0.1 to ~0.95: the shipped pair, the shipped draft made
worse by noise in its weights (three levels), the target itself with a little noise as its own
draft (accepts almost everything, costs a target step per draft step), the n-gram drafter, and
any pair given with --pair (e.g. one trained with scripts/train_pair.py under another seed, which
the policy was not tuned on). Noisy drafts are built once and cached (--cache-dir).

Each system runs each prompt group (the row's batch) --repeats times, the systems taking turns in
an order rotated every time, and a group counts its median time: a shared machine has slow spells
(tenths of a second at 1.5-3x) that would otherwise land on whichever system ran then. A second
plain run ("plain again", the A/A column) is timed like every other system: its ratio to the first
is the row's remaining measurement noise.

  specdec bench-policy                                  # every pair, batch 1 and 8, greedy and T=0.8
  specdec bench-policy --pair /work/pair2/target:/work/pair2/draft --json policy.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdec.config import NGRAM, SHIPPED_DRAFT, SHIPPED_TARGET, ServiceConfig
from specdec.tokenizer import load_tokenizer
from specdec_app.bench.engine_runner import EngineSystem, kv_blocks_for
from specdec_app.bench.prompts import chunks, load_prompts, prompt_entries
from specdec_app.bench.results import Mode, pool_runs
from specdec_app.flags import add_settings, given_settings

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec" / "bench-models"
DRAFT_NOISE = (0.6, 1.2, 2.4)  # relative noise added to the shipped draft's weights (acceptance falls)
SELF_NOISE = 0.05  # the target as its own draft, slightly perturbed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--pair", action="append", default=[], metavar="TARGET:DRAFT",
                        help="another pair to measure (repeatable); DRAFT may be 'ngram'")
    parser.add_argument("--only-pairs", action="store_true", help="measure only the --pair pairs")
    parser.add_argument("--prompts", default=str(SHIPPED_TARGET.parent / "heldout_prompts.jsonl"),
                        help="JSONL prompts (default: the shipped code prompts)")
    parser.add_argument("--num-prompts", type=int, default=4,
                        help="prompts per row (default 4); a row of a larger batch size runs that many")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="times each system runs each prompt group, in turn with the others; "
                             "a group's median time counts (default 3)")
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated (default 1,8)")
    parser.add_argument("--temperatures", default="0,0.8", help="comma-separated; 0 = greedy (default 0,0.8)")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=5, help="K_max (default 5)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="where noisy drafts are kept")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 prompts, 12 tokens, batch 1 greedy")
    add_settings(parser, ["draft_weights"])


def noisy_copy(source: str, noise: float, cache_dir: Path, seed: int = 1) -> str:
    """A copy of the checkpoint `source` with N(0, (noise * std)^2) added to every weight tensor;
    built once under cache_dir."""
    out = cache_dir / f"{Path(source).resolve().name}-noise{noise:g}-seed{seed}"
    if (out / "model.safetensors").exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    for item in Path(source).iterdir():
        if item.name != "model.safetensors" and item.is_file():
            shutil.copy(item, out / item.name)
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(Path(source) / "model.safetensors"))
    noisy = {name: t + torch.randn(t.shape, generator=gen) * noise * t.float().std().clamp_min(1e-3)
             for name, t in tensors.items()}
    save_file(noisy, str(out / "model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(out / "model.safetensors.tmp", out / "model.safetensors")
    return str(out)


def pairs(args) -> list[tuple[str, str, str]]:
    """(name, target, draft) of every pair measured."""
    cache = Path(args.cache_dir)
    target, draft = str(SHIPPED_TARGET), str(SHIPPED_DRAFT)
    family = [] if args.only_pairs else (
        [("shipped", target, draft)]
        + [(f"draft+noise {n:g}", target, noisy_copy(draft, n, cache)) for n in DRAFT_NOISE]
        + [(f"target+noise {SELF_NOISE:g}", target, noisy_copy(target, SELF_NOISE, cache)),
           ("n-gram", target, NGRAM)])
    for spec in args.pair:
        given_target, _, given_draft = spec.rpartition(":")
        if not given_target:
            raise ValueError(f"--pair {spec!r}: expected TARGET:DRAFT")
        name = Path(given_target).parent.name or given_target
        if name in (taken[0] for taken in family):  # (pairs sharing a target's folder: by their drafts)
            name += f"+{Path(given_draft).name}"
        family.append((name, given_target, given_draft))
    return family


def measure_pair(name, target, draft, prompts_file, args, modes, batches, log) -> list[dict]:
    k = args.num_speculative_tokens
    tokenizer, available = load_tokenizer(target), len(prompt_entries(prompts_file))
    row_prompts = {batch: load_prompts(prompts_file, max(args.num_prompts, min(batch, available)), tokenizer)[0]
                   for batch in batches}  # (a batch-8 row runs 8 requests at once, as far as the file has them)
    blocks = kv_blocks_for([p for prompts in row_prompts.values() for p in prompts], args.max_new_tokens, k,
                           max(batches))
    kind = "spec-ngram" if draft == NGRAM else "spec-draft"
    weights = ("auto", args.draft_weights)
    systems = {"plain": EngineSystem("engine", target, None, k, blocks, max(batches)),
               "adaptive": EngineSystem(kind, target, draft, k, blocks, max(batches), adaptive=True, weights=weights),
               "fixed": EngineSystem(f"{kind}-fixed", target, draft, k, blocks, max(batches), adaptive=False,
                                     weights=weights)}
    rows = []
    for mode in modes:
        for batch in batches:
            prompts = row_prompts[batch]
            # label -> (system, K): "plain again" is the A/A control, never a candidate for best
            runs = {"plain": ("plain", None), "plain again": ("plain", None), "adaptive": ("adaptive", None),
                    **{f"K={kk}": ("fixed", kk) for kk in range(1, k + 1)}}
            for system, kk in runs.values():
                systems[system].warm_up(prompts, batch, mode, 0, k=kk)

            def run_one(label, group, batch=batch, mode=mode, runs=runs):
                system, kk = runs[label]
                return systems[system].run(group, batch, mode, args.max_new_tokens, 0, k=kk)

            rate, results = time_in_turns(list(runs), list(chunks(prompts, batch)), args.repeats, run_one)
            best = max((label for label in rate if label not in ("adaptive", "plain again")), key=rate.get)
            adaptive_result = pool_runs(results["adaptive"])
            row = {"pair": name, "batch": batch, "prompts": len(prompts), "mode": mode.name, "plain": rate["plain"],
                   "plain_again": rate["plain again"], "adaptive": rate["adaptive"],
                   "fixed": {str(kk): rate[f"K={kk}"] for kk in range(1, k + 1)},
                   "best": best, "best_rate": rate[best],
                   "alpha": adaptive_result.alpha, "mean_k": adaptive_result.mean_k}
            row["vs_best"], row["vs_plain"] = row["adaptive"] / row["best_rate"], row["adaptive"] / row["plain"]
            row["noise"] = abs(row["plain_again"] / row["plain"] - 1.0)  # two timings of one system
            log(f"  {name:22s} b{batch} ({len(prompts)} prompts) {mode.name:6s} adaptive/best "
                f"{row['vs_best']:.2f}x ({row['best']}), /plain {row['vs_plain']:.2f}x, "
                f"A/A {row['plain_again'] / row['plain']:.2f}x, alpha {_fmt(row['alpha'])}, "
                f"mean K {_fmt(row['mean_k'])}")
            rows.append(row)
    return rows


def time_in_turns(labels: list[str], groups: list, repeats: int, run) -> tuple[dict, dict]:
    """Tokens/s of each label's system, and its results: each runs each group `repeats` times, the
    labels taking turns in an order rotated every time (each after a different one), and a group
    counts its median seconds: a slow spell of the machine (tenths of a second at 1.5-3x) lands on
    one label's group in one repeat, not on all of them. run(label, group) -> RunResult."""
    seconds = {label: [[] for _ in groups] for label in labels}  # label -> group -> each repeat's
    tokens, results = dict.fromkeys(labels, 0), {label: [] for label in labels}
    for repeat in range(repeats):
        for g, group in enumerate(groups):
            turn = (repeat * len(groups) + g) % len(labels)
            for label in labels[turn:] + labels[:turn]:
                result = run(label, group)
                seconds[label][g].append(result.seconds)
                tokens[label] += result.tokens if repeat == 0 else 0
                results[label].append(result)
    return {label: tokens[label] / sum(map(statistics.median, seconds[label])) for label in labels}, results


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(rows: list[dict], k: int) -> str:
    head = ["pair", "batch", "mode", "alpha", "plain tok/s", "A/A"] + [f"K={kk}" for kk in range(1, k + 1)] + [
        "adaptive", "mean K", "best", "adaptive/best"]
    lines = [head]
    for r in rows:
        lines.append([r["pair"], str(r["batch"]), r["mode"], _fmt(r["alpha"]), f"{r['plain']:.1f}",
                      f"{r['plain_again'] / r['plain']:.2f}x"]
                     + [f"{r['fixed'][str(kk)] / r['plain']:.2f}x" for kk in range(1, k + 1)]
                     + [f"{r['vs_plain']:.2f}x", _fmt(r["mean_k"]), r["best"], f"{r['vs_best']:.2f}x"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    worst_best = min(rows, key=lambda r: r["vs_best"])
    worst_plain = min(rows, key=lambda r: r["vs_plain"])
    text.append(f"\nworst adaptive/best: {worst_best['vs_best']:.2f}x ({worst_best['pair']}, b{worst_best['batch']} "
                f"{worst_best['mode']}); worst adaptive/plain: {worst_plain['vs_plain']:.2f}x ({worst_plain['pair']}, "
                f"b{worst_plain['batch']} {worst_plain['mode']}) (K and adaptive columns: x plain)")
    beyond = [r for r in rows if r["vs_best"] < 0.95 - r["noise"]]
    text.append(f"A/A: plain timed twice, median difference {sorted(r['noise'] for r in rows)[len(rows) // 2]:.2f}; "
                f"rows below 0.95x best by more than their A/A difference: {len(beyond)} of {len(rows)}")
    return "\n".join(text)


def run(args) -> int:
    if args.quick:
        args.num_prompts, args.max_new_tokens, args.batch_sizes, args.temperatures = 2, 12, "1", "0"
    try:
        if args.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
        batches = [int(b) for b in args.batch_sizes.split(",")]
        if min(batches) < 1 or args.num_prompts < 1:
            raise ValueError("--batch-sizes and --num-prompts must be at least 1")
        modes = [Mode("greedy" if float(t) == 0 else f"T={float(t):g}", float(t)) for t in args.temperatures.split(",")]
        args.draft_weights = ServiceConfig.from_settings(**given_settings(args, ["draft_weights"])).draft.weights
        family = pairs(args)
    except ValueError as e:  # (a bad setting: ConfigError)
        print(f"specdec bench-policy: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    log(f"specdec bench-policy: {len(family)} pairs, batch sizes {batches}, {[m.name for m in modes]}, "
        f"{args.num_prompts} prompts (or a batch's size) x {args.max_new_tokens} tokens x {args.repeats} repeats, "
        f"K_max {args.num_speculative_tokens}, "
        f"draft weights {args.draft_weights}; load average {load}")
    start, rows = time.perf_counter(), []
    for name, target, draft in family:
        try:
            rows += measure_pair(name, target, draft, args.prompts, args, modes, batches, log)
        except (OSError, ValueError) as e:  # (the prompts file: missing, too few prompts, a bad line)
            print(f"specdec bench-policy: {e}", file=sys.stderr)
            return 2
    print(format_table(rows, args.num_speculative_tokens))
    end_load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"\n{time.perf_counter() - start:.0f}s; load average {load} at start, {end_load} at end")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "draft_weights": args.draft_weights,
                                               "rows": rows, "load_average": [load, end_load]}, indent=1))
    return 0
