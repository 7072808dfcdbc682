"""`specdec bench`: tokens/s of specdec (plain; draft model and n-gram, each with K adaptive and
fixed) vs Hugging Face `generate` (plain and assisted), greedy and sampled, at several batch
sizes, on one or more prompt sets (code and prose by default), in one run.

Prints a table per prompt set (tokens/s, ratios, acceptance, mean accepted length, the K chosen,
cost ratio c, expected speedup and the share of it measured), the step-cost measurement, where
specdec's time went, and the release targets; writes bench.json and bench.png under --out.
`--sweep-k` adds a speedup-vs-K sweep on the first prompt set.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from specdec.app.bench import overlap as overlap_bench
from specdec.app.flags import add_settings, format_default, given_settings
from specdec.config import NGRAM, REPO_ROOT, SHIPPED_DRAFT, SHIPPED_TARGET, ConfigError, ServiceConfig, WorkerConfig
from specdec.kv_cache import blocks_for_tokens

ALL_SYSTEMS = ["engine", "spec-draft", "spec-draft-fixed", "spec-ngram", "spec-ngram-fixed", "hf", "hf-assisted"]
DEFAULT_SWEEP = "1,2,3,4,6,8"
# The shipped prompt sets (JSONL, {"prompt": text, "source": ...} per line), by the name --prompt-sets uses.
PROMPT_SETS = {"code": "models/heldout_prompts.jsonl", "prose": "models/prose_prompts.jsonl"}
SHIPPED_PAIR = (str(SHIPPED_TARGET), str(SHIPPED_DRAFT))


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


def _prompt_sets(text: str) -> list[str]:
    names = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [n for n in names if n not in PROMPT_SETS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown prompt set(s) {bad}; choose from {','.join(PROMPT_SETS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    add_settings(parser, ["target"])
    parser.add_argument("--draft", default=str(SHIPPED_DRAFT),
                        help="draft model of the spec-draft system: checkpoint directory, .gguf file or Hub id "
                             f"(default: {format_default(str(SHIPPED_DRAFT))})")
    parser.add_argument("--prompt-sets", type=_prompt_sets, default=list(PROMPT_SETS),
                        help="comma-separated shipped prompt sets: "
                             + ", ".join(f"{name} ({path})" for name, path in PROMPT_SETS.items())
                             + f" (default {','.join(PROMPT_SETS)})")
    parser.add_argument("--prompts", default=None, metavar="FILE",
                        help='JSONL, one {"prompt": text} or {"prompt_ids": [ids]} per line; replaces '
                             "--prompt-sets with this one file, named by its stem (or by the shipped set it is)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="prompts per run and prompt set, spread over the file (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens generated per prompt (default 128)")
    add_settings(parser, ["num_speculative_tokens"])
    parser.add_argument("--batch-sizes", type=_int_list, default=None, help="comma-separated (default 1,8)")
    parser.add_argument("--temperatures", type=_float_list, default=[0.0, 0.8],
                        help="comma-separated; 0 = greedy (default 0,0.8)")
    parser.add_argument("--systems", type=_systems, default=list(ALL_SYSTEMS),
                        help=f"subset of {','.join(ALL_SYSTEMS)} (default: all)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads for every system (default 2)")
    parser.add_argument("--seed", type=int, default=0,
                        help="base seed of HF's sampled runs (specdec's sampled requests are unseeded, like "
                             "typical traffic: a seeded request's K follows a restricted rule)")
    parser.add_argument("--sweep-k", nargs="?", const=DEFAULT_SWEEP, default=None, metavar="K1,K2,...",
                        help="also sweep K (adaptive systems: the most K) for the speculative systems at batch 1 "
                             f"greedy on the first prompt set (default list {DEFAULT_SWEEP})")
    parser.add_argument("--sweep-only", action="store_true", help="with --sweep-k: skip the main grid")
    parser.add_argument("--cost-steps", type=int, default=None,
                        help="timed passes per step-cost measurement (default 30)")
    parser.add_argument("--out", default="bench_out", help="output folder for bench.json and bench.png")
    parser.add_argument("--quick", action="store_true",
                        help="tiny smoke run: 2 prompts per set, 16 new tokens, batch sizes 1,2")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs of every system per row, in mirrored order (the systems forward, then "
                             "backward, ...) and pooled, so a machine that speeds up or slows down during a row "
                             "moves every system alike (default 2; 1 with --quick)")
    parser.add_argument("--oracle", action="store_true",
                        help="also run every fixed K from 1 to K for each adaptive system and row, and print the "
                             "adaptive row's ratio to the best of plain and those (specdec bench-policy always does)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    overlap_bench.add_arguments(parser)


def _resolve(path: str) -> str:
    """Relative paths are tried from the working directory, then from the repository (anything
    else, a Hub id included, is left as it is)."""
    p = Path(path)
    if p.is_absolute() or p.exists() or path == NGRAM:
        return str(p)
    alt = REPO_ROOT / p
    return str(alt) if alt.exists() else str(p)


def _model_problem(spec: str) -> str | None:
    """Why a model spec (checkpoint directory, .gguf file or Hub id) cannot be loaded, or None."""
    from specdec.model.source import resolve_model_source

    try:
        resolve_model_source(spec)
    except ValueError as e:
        return str(e)
    return None


def _prompt_set_name(path: str) -> str:
    """A --prompts file is named by the shipped set it is, else by its stem."""
    for name, shipped in PROMPT_SETS.items():
        if Path(_resolve(shipped)).resolve() == Path(path).resolve():
            return name
    return Path(path).stem


def _load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _format_load(load: list[float] | None) -> str:
    return "unknown" if load is None else " ".join(f"{x:.2f}" for x in load)


def _environment(args, param_counts: dict, load_at_start: list[float] | None) -> dict:
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
        "load_average_at_start": load_at_start,
        "parameters": param_counts,
    }


def _kv_blocks(prompts: list[list[int]], max_new: int, max_k: int, max_batch: int) -> int:
    """Room for a full batch of the longest prompt plus its output and draft tokens."""
    tokens = max(len(p) for p in prompts) + max_new + max_k + 2
    return max_batch * (blocks_for_tokens(tokens, WorkerConfig().kv_block_size) + 2) + 8


def _oracle_row(built: dict, systems: list[str], results: list, set_name: str, mode, batch: int,
                prompts: list[list[int]], max_new: int, k: int, repeats: int, seed: int, target: str, draft: str,
                kv_blocks: int, max_batch: int) -> list[dict]:
    """--oracle: for each adaptive system of this row, every fixed K from 1 to k (its fixed twin,
    built if it was not asked for), and the best of plain and those beside the adaptive figure."""
    from specdec.app.bench.runners import SYSTEMS, EngineSystem, pool_runs

    def row_result(key: str):
        return next(r for r in reversed(results) if r.system == key and r.batch == batch and r.mode == mode.name
                    and r.prompt_set == set_name)

    out = []
    for key in [s for s in systems if SYSTEMS[s].adaptive]:
        fixed_key = f"{key}-fixed"
        if fixed_key not in built:
            drafter = NGRAM if SYSTEMS[key].drafter == "ngram" else draft
            built[fixed_key] = EngineSystem(fixed_key, target, drafter, k, kv_blocks, max_batch, adaptive=False)
        rates = {}
        for kk in range(1, k + 1):
            runs = []
            for _ in range(repeats):
                built[fixed_key].warm_up(prompts, batch, mode, seed, k=kk)
                runs.append(built[fixed_key].run(prompts, batch, mode, max_new, seed, k=kk, prompt_set=set_name))
            rates[f"K={kk}"] = pool_runs(runs).tokens_per_s
        plain = row_result("engine").tokens_per_s if "engine" in systems else None
        if plain:
            rates["plain"] = plain
        best = max(rates, key=rates.get)
        adaptive = row_result(key).tokens_per_s
        out.append({"system": key, "prompt_set": set_name, "batch": batch, "mode": mode.name, "adaptive": adaptive,
                    "fixed": {n: v for n, v in rates.items() if n != "plain"}, "plain": plain, "best": best,
                    "best_tokens_per_s": rates[best], "adaptive_vs_best": adaptive / rates[best]})
    return out


def _format_oracle(rows: list[dict]) -> str:
    lines = ["the adaptive policy against the best of plain and every fixed K, measured in this run (--oracle):"]
    for r in rows:
        lines.append(f"  {r['prompt_set']:6s} b{r['batch']} {r['mode']:6s} {r['system']:11s} adaptive "
                     f"{r['adaptive']:7.1f} tok/s, best {r['best']:6s} {r['best_tokens_per_s']:7.1f} tok/s -> "
                     f"{r['adaptive_vs_best']:.2f}x")
    worst = min(rows, key=lambda r: r["adaptive_vs_best"])
    lines.append(f"  worst: {worst['adaptive_vs_best']:.2f}x ({worst['prompt_set']} b{worst['batch']} {worst['mode']} "
                 f"{worst['system']})")
    return "\n".join(lines)


def run(args) -> int:
    import torch
    from tqdm import tqdm

    from specdec.app.bench import report
    from specdec.app.bench.runners import (
        SPECDEC_SYSTEMS,
        SPECULATIVE_SYSTEMS,
        SYSTEMS,
        EngineSystem,
        HFSystem,
        Mode,
        load_hf,
        load_prompts,
        measure_step_costs,
        pool_runs,
    )
    from specdec.tokenizer import load_tokenizer

    load_at_start = _load_average()
    quick = args.quick
    num_prompts = args.num_prompts or (2 if quick else 8)
    max_new = args.max_new_tokens or (16 if quick else 128)
    batch_sizes = args.batch_sizes or ([1, 2] if quick else [1, 8])
    cost_steps = args.cost_steps or (5 if quick else 30)
    repeats = args.repeats if args.repeats is not None else (1 if quick else 2)
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
    if num_prompts < 1 or max_new < 1 or k < 1 or args.threads < 1 or repeats < 1:
        print("specdec bench: --num-prompts, --max-new-tokens, -k, --threads and --repeats must be >= 1",
              file=sys.stderr)
        return 2
    modes = [Mode("greedy" if t == 0 else f"T={t:g}", t) for t in args.temperatures]
    systems = list(args.systems)
    torch.set_num_threads(args.threads)
    target, draft = _resolve(config.target.model), _resolve(args.draft)
    if args.prompts is not None:
        set_files = {_prompt_set_name(_resolve(args.prompts)): _resolve(args.prompts)}
    else:
        set_files = {name: _resolve(PROMPT_SETS[name]) for name in args.prompt_sets}
    needs_draft = any(SYSTEMS[s].needs_draft for s in systems)
    for what, spec in [("target", target)] + ([("draft", draft)] if needs_draft else []):
        problem = _model_problem(spec)
        if problem:
            print(f"specdec bench: {what}: {problem}"
                  + (" (train the pair with scripts/train_pair.py)" if spec in SHIPPED_PAIR else ""), file=sys.stderr)
            return 2
    for name, path in set_files.items():
        if not Path(path).exists():
            print(f"specdec bench: prompts ({name}) {path!r} does not exist", file=sys.stderr)
            return 2
    out_dir = Path(args.out)
    show = not args.no_progress

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    log(f"load average (1, 5, 15 min) at start: {_format_load(load_at_start)} on {os.cpu_count()} CPUs")
    if load_at_start and load_at_start[0] > 0.5 * (os.cpu_count() or 1):
        log(f"warning: load average {load_at_start[0]:.1f} on {os.cpu_count()} CPUs before starting: other work "
            "is running, so timings will be noisy (and threads > free cores can be many times slower)")
    tokenizer = load_tokenizer(target)
    prompt_sets: dict[str, tuple[list[list[int]], list[str]]] = {}
    for name, path in set_files.items():
        try:
            prompt_sets[name] = load_prompts(path, num_prompts, tokenizer)
        except ValueError as e:
            print(f"specdec bench: {e}", file=sys.stderr)
            return 2
    first_set = next(iter(prompt_sets))
    every_prompt = [p for ids, _ in prompt_sets.values() for p in ids]
    kv_blocks = _kv_blocks(every_prompt, max_new, max([k] + sweep_ks), max(batch_sizes))
    for name, (ids, _) in prompt_sets.items():
        log(f"specdec bench: prompt set {name}: {len(ids)} prompts ({min(map(len, ids))}-{max(map(len, ids))} "
            f"tokens) from {set_files[name]}")
    log(f"specdec bench: {max_new} new tokens each, K={k}, batch sizes {batch_sizes}, {args.threads} threads")
    if args.overlap_only:
        rows, text = overlap_bench.run_section(args, target, draft, prompt_sets, modes, batch_sizes, k, max_new,
                                               kv_blocks, log)
        print(text)
        from specdec.app.bench import report

        report.write_json(out_dir / "overlap.json", {"command": " ".join(shlex.quote(a) for a in sys.argv),
                                                     "load_average": [load_at_start, _load_average()],
                                                     "overlap": [dataclasses.asdict(r) for r in rows]})
        print(f"\nload average (1, 5, 15 min): {_format_load(load_at_start)} at start, "
              f"{_format_load(_load_average())} at end, on {os.cpu_count()} CPUs")
        return 0

    # -- load every system once ----------------------------------------------------------------
    t0 = time.perf_counter()
    built: dict = {}
    hf_target = None
    drafter_paths = {None: None, "model": draft, "ngram": NGRAM}
    for key in tqdm(systems, desc="loading", disable=not show, leave=False):
        spec = SYSTEMS[key]
        if key in SPECDEC_SYSTEMS:
            built[key] = EngineSystem(key, target, drafter_paths[spec.drafter], k, kv_blocks, max(batch_sizes),
                                      adaptive=spec.adaptive)
        else:
            hf_target = hf_target if hf_target is not None else load_hf(target)
            built[key] = HFSystem(key, target, draft if key == "hf-assisted" else None, k, model=hf_target)
    log(f"loaded {len(built)} systems in {time.perf_counter() - t0:.1f}s")

    from specdec.model.decoder import load_model

    params = {"target": load_model(target).num_parameters}
    if needs_draft:
        params["draft"] = load_model(draft).num_parameters
    env = _environment(args, params, load_at_start)

    # -- cost ratio c, per prompt set (context lengths differ) ---------------------------------
    costs_by_set = None
    if any(s in systems for s in SPECULATIVE_SYSTEMS):
        log("measuring draft/target step costs ...")
        has_draft = draft != NGRAM and _model_problem(draft) is None
        costs_by_set = measure_step_costs(target, draft if has_draft else None,
                                          {name: ids for name, (ids, _) in prompt_sets.items()}, batch_sizes, k,
                                          cost_steps, kv_cache_blocks=kv_blocks)

    # -- main grid -----------------------------------------------------------------------------------
    # Prompt set outermost: the adaptive policy's running acceptance estimate then moves from one
    # set to the other once (during the next set's warm-ups), not back and forth. Within a row the
    # systems run `repeats` times in mirrored order and each one's runs are pooled: on a shared
    # machine whose speed drifts by 10-20% within a minute, one run per system compared runs taken
    # at different speeds; mirrored, a linear drift weighs every system alike.
    results, oracle = [], []
    rows = [] if args.sweep_only else [(n, m, b) for n in prompt_sets for m in modes for b in batch_sizes]
    total_tokens = repeats * sum(max_new * len(prompt_sets[n][0]) for n, m, b in rows for s in systems
                                 if not (SYSTEMS[s].batch1_only and b != 1))
    overall = tqdm(total=total_tokens, desc="bench", unit="tok", disable=not show, position=0)
    try:
        for set_name, mode, batch in rows:
            prompts = prompt_sets[set_name][0]
            runs: dict[str, list] = {key: [] for key in systems}
            for repeat in range(repeats):
                for key in systems if repeat % 2 == 0 else systems[::-1]:
                    overall.set_postfix_str(f"{set_name} {key} b{batch} {mode.name}")
                    built[key].warm_up(prompts, batch, mode, args.seed)
                    runs[key].append(built[key].run(prompts, batch, mode, max_new, args.seed, bar=overall,
                                                    prompt_set=set_name))
            results += [pool_runs(runs[key]) for key in systems]
            if args.oracle:
                oracle += _oracle_row(built, systems, results, set_name, mode, batch, prompts, max_new, k, repeats,
                                      args.seed, target, draft, kv_blocks, max(batch_sizes))
    finally:
        overall.close()

    # -- K sweep (first prompt set only) ---------------------------------------------------------------
    sweep = []
    sweep_baseline = []
    sweep_systems = [s for s in SPECULATIVE_SYSTEMS if s in systems]
    if sweep_ks and sweep_systems:
        prompts = prompt_sets[first_set][0]
        greedy = modes[0] if modes[0].greedy else Mode("greedy", 0.0)
        base = [r for r in results
                if r.system == "engine" and r.batch == 1 and r.mode == greedy.name and r.prompt_set == first_set]
        if not base:
            plain = built.get("engine") or EngineSystem("engine", target, None, k, kv_blocks, max(batch_sizes))
            plain.warm_up(prompts, 1, greedy, args.seed)
            base = [plain.run(prompts, 1, greedy, max_new, args.seed, prompt_set=first_set)]
        sweep_baseline = base
        bar = tqdm(total=len(sweep_ks) * len(sweep_systems) * max_new * len(prompts), desc="sweep K", unit="tok",
                   disable=not show)
        try:
            for key in sweep_systems:
                for sk in sweep_ks:
                    bar.set_postfix_str(f"{key} K={sk}")
                    built[key].warm_up(prompts, 1, greedy, args.seed, k=sk)
                    sweep.append(built[key].run(prompts, 1, greedy, max_new, args.seed, k=sk, bar=bar,
                                                prompt_set=first_set))
        finally:
            bar.close()
        report.annotate(sweep, costs_by_set, baselines=sweep_baseline)

    report.annotate(results, costs_by_set)
    targets = report.evaluate_targets(results)

    # -- report --------------------------------------------------------------------------------------
    print()
    if results:
        sets_text = ", ".join(f"{name} ({len(ids)} prompts)" for name, (ids, _) in prompt_sets.items())
        print(f"tokens/s on {sets_text} x {max_new} new tokens (K={k}, {args.threads} threads, "
              f"{os.cpu_count()} CPUs)\n"
              "  x plain / x HF / x HF-asst: tok/s ratio to specdec plain / HF generate / HF assisted, "
              "same prompt set, batch and mode\n"
              "  accept = accepted/proposed; alpha = accepted/tested (per-token, what the formula assumes)\n"
              "  mean K, K=0: the K asked per request and round (adaptive: the policy's choice, at most K; fixed: K "
              "but less near the end), and the share of those that were 0\n"
              "  theory x = (1-a^(K+1))/((1-a)(Kc+1)) with a = alpha; for adaptive rows the best fixed K's: max over "
              "k = 1..K\n"
              "  % theory = x plain / theory x; =plain: greedy outputs identical to specdec plain's\n")
        print(report.format_table(results))
        print()
    if sweep:
        print(f"K sweep (prompt set {first_set} only, batch 1, greedy; adaptive systems: K = the most per round; "
              f"x plain vs specdec plain {sweep_baseline[0].tokens_per_s:.1f} tok/s):")
        print(report.format_table(sweep))
        print()
    print(report.format_costs(costs_by_set))
    print()
    if results:
        print(report.format_breakdown(results))
        print()
        print(report.format_targets(targets))
        if oracle:
            print()
            print(_format_oracle(oracle))
        hf_assisted_skipped = any(r.skipped for r in results if r.system == "hf-assisted")
        if hf_assisted_skipped:
            print("note: HF assisted generation supports batch size 1 only; its batch > 1 rows are n/a")

    overlap_rows = []
    if args.overlap:
        overlap_rows, text = overlap_bench.run_section(args, target, draft, prompt_sets, modes, batch_sizes, k,
                                                       max_new, kv_blocks, log)
        print(text)
    env["load_average_at_end"] = _load_average()
    first_ids, first_sources = prompt_sets[first_set]
    payload = {
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "arguments": {k_: v for k_, v in vars(args).items() if k_ != "func"},
        # prompts_file .. prompt_lengths describe the first prompt set (as before there were
        # several); prompt_sets describes each.
        "config": {"target": target, "draft": draft, "prompts_file": set_files[first_set],
                   "num_prompts": len(first_ids), "prompt_sources": first_sources,
                   "prompt_lengths": [len(p) for p in first_ids],
                   "prompt_sets": {name: {"prompts_file": set_files[name], "num_prompts": len(ids),
                                          "prompt_sources": sources, "prompt_lengths": [len(p) for p in ids]}
                                   for name, (ids, sources) in prompt_sets.items()},
                   "max_new_tokens": max_new, "num_speculative_tokens": k, "batch_sizes": batch_sizes,
                   "modes": [{"name": m.name, "temperature": m.temperature} for m in modes],
                   "systems": systems, "seed": args.seed, "threads": args.threads, "kv_cache_blocks": kv_blocks,
                   "repeats": repeats, "repeat_order": "mirrored: systems forward, then backward; runs pooled",
                   "sampled_requests": "specdec: unseeded (typical traffic); HF: torch.manual_seed(seed + offset)",
                   "hf_assisted": {"num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant",
                                   "note": "batch size 1 only"},
                   "sweep_prompt_set": first_set if sweep else None,
                   "eos": "ignored: specdec ignore_eos=True, HF min_new_tokens=max_new_tokens"},
        "environment": env,
        "cost": (costs_by_set or {}).get(first_set),  # the first prompt set's, as before
        "cost_by_prompt_set": costs_by_set,
        "results": [r.to_json() for r in results],
        "sweep": [r.to_json() for r in sweep],
        "sweep_baseline": [r.to_json() for r in sweep_baseline],
        "targets": targets,
        "overlap": [dataclasses.asdict(r) for r in overlap_rows],
        "oracle": oracle,
    }
    json_path, png_path = out_dir / "bench.json", out_dir / "bench.png"
    report.write_json(json_path, payload)
    title = (f"specdec bench: {num_prompts} prompts per set x {max_new} tokens, K={k}, {args.threads} threads, "
             f"target {params['target'] / 1e6:.1f}M"
             + (f", draft {params['draft'] / 1e6:.1f}M" if "draft" in params else ""))
    report.write_plot(png_path, results, sweep, title)
    print(f"\nload average (1, 5, 15 min): {_format_load(load_at_start)} at start, "
          f"{_format_load(env['load_average_at_end'])} at end, on {os.cpu_count()} CPUs")
    print(f"wrote {json_path} and {png_path}")
    return 0
