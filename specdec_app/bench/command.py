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
import os
import shlex
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.config import NGRAM, ConfigError, ServiceConfig
from specdec.model.decoder import load_model
from specdec.sampling.tree import tree_size
from specdec.tokenizer import load_tokenizer
from specdec_app.bench import overlap as overlap_bench
from specdec_app.bench import report
from specdec_app.bench.arguments import (
    PROMPT_SETS,
    SHIPPED_PAIR,
    add_bench_arguments,
    int_list,
    model_problem,
    prompt_set_name,
    resolve_path,
)
from specdec_app.bench.engine_runner import EngineSystem, kv_blocks_for
from specdec_app.bench.environment import environment, format_load, load_average
from specdec_app.bench.hf_runner import HFSystem, load_hf
from specdec_app.bench.oracle import format_oracle, oracle_row
from specdec_app.bench.prompts import load_prompts
from specdec_app.bench.results import SPECDEC_SYSTEMS, SPECULATIVE_SYSTEMS, SYSTEMS, Mode, pool_runs
from specdec_app.bench.step_costs import measure_step_costs
from specdec_app.flags import given_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    add_bench_arguments(parser)


def run(args) -> int:
    load_at_start = load_average()
    quick = args.quick
    num_prompts = args.num_prompts or (2 if quick else 8)
    max_new = args.max_new_tokens or (16 if quick else 128)
    batch_sizes = args.batch_sizes or ([1, 2] if quick else [1, 8])
    cost_steps = args.cost_steps or (5 if quick else 30)
    repeats = args.repeats if args.repeats is not None else (1 if quick else 2)
    try:
        config = ServiceConfig.from_settings(**given_settings(args, ["target", "num_speculative_tokens",
                                                                     "target_weights", "draft_weights"]))
    except ConfigError as e:
        print(f"specdec bench: {e}", file=sys.stderr)
        return 2
    k = config.scheduler.num_speculative_tokens
    sweep_ks = int_list(args.sweep_k) if args.sweep_k else []
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
    target, draft = resolve_path(config.target.model), resolve_path(args.draft)
    weights = (config.target.weights, config.draft.weights)  # the target's and the draft's weight formats
    if args.prompts is not None:
        set_files = {prompt_set_name(resolve_path(args.prompts)): resolve_path(args.prompts)}
    else:
        set_files = {name: resolve_path(PROMPT_SETS[name]) for name in args.prompt_sets}
    needs_draft = any(SYSTEMS[s].needs_draft for s in systems)
    for what, spec in [("target", target)] + ([("draft", draft)] if needs_draft else []):
        problem = model_problem(spec)
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

    log(f"load average (1, 5, 15 min) at start: {format_load(load_at_start)} on {os.cpu_count()} CPUs")
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
    tree_nodes = tree_size(k, args.tree_branches, args.tree_side_depth) if any(SYSTEMS[s].tree for s in systems) else 0
    kv_blocks = kv_blocks_for(every_prompt, max_new, max([k, tree_nodes] + sweep_ks), max(batch_sizes))
    for name, (ids, _) in prompt_sets.items():
        log(f"specdec bench: prompt set {name}: {len(ids)} prompts ({min(map(len, ids))}-{max(map(len, ids))} "
            f"tokens) from {set_files[name]}")
    log(f"specdec bench: {max_new} new tokens each, K={k}, batch sizes {batch_sizes}, {args.threads} threads")
    if args.overlap_only:
        rows, text = overlap_bench.run_section(args, target, draft, prompt_sets, modes, batch_sizes, k, max_new,
                                               kv_blocks, log)
        print(text)
        report.write_json(out_dir / "overlap.json", {"command": " ".join(shlex.quote(a) for a in sys.argv),
                                                     "load_average": [load_at_start, load_average()],
                                                     "overlap": [dataclasses.asdict(r) for r in rows]})
        print(f"\nload average (1, 5, 15 min): {format_load(load_at_start)} at start, "
              f"{format_load(load_average())} at end, on {os.cpu_count()} CPUs")
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
                                      adaptive=spec.adaptive, weights=weights,
                                      tree_branches=args.tree_branches if spec.tree else 1,
                                      tree_side_depth=args.tree_side_depth)
        else:
            hf_target = hf_target if hf_target is not None else load_hf(target)
            built[key] = HFSystem(key, target, draft if key == "hf-assisted" else None, k, model=hf_target)
    log(f"loaded {len(built)} systems in {time.perf_counter() - t0:.1f}s")

    params = {"target": load_model(target).num_parameters}
    if needs_draft:
        params["draft"] = load_model(draft).num_parameters
    env = environment(args, params, load_at_start)
    env["weights"] = dict(zip(("target", "draft"), weights))

    # -- cost ratio c, per prompt set (context lengths differ) ---------------------------------
    costs_by_set = None
    if any(s in systems for s in SPECULATIVE_SYSTEMS):
        log("measuring draft/target step costs ...")
        has_draft = draft != NGRAM and model_problem(draft) is None
        costs_by_set = measure_step_costs(target, draft if has_draft else None,
                                          {name: ids for name, (ids, _) in prompt_sets.items()}, batch_sizes, k,
                                          cost_steps, kv_cache_blocks=kv_blocks,
                                          weights=weights)

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
                oracle += oracle_row(built, systems, results, set_name, mode, batch, prompts, max_new, k, repeats,
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
            plain = built.get("engine") or EngineSystem("engine", target, None, k, kv_blocks, max(batch_sizes),
                                                        weights=weights)
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
        if any(SYSTEMS[r.system].tree for r in results):
            print(report.format_depths(results))
            print()
        print(report.format_targets(targets))
        if oracle:
            print()
            print(format_oracle(oracle))
        hf_assisted_skipped = any(r.skipped for r in results if r.system == "hf-assisted")
        if hf_assisted_skipped:
            print("note: HF assisted generation supports batch size 1 only; its batch > 1 rows are n/a")

    overlap_rows = []
    if args.overlap:
        overlap_rows, text = overlap_bench.run_section(args, target, draft, prompt_sets, modes, batch_sizes, k,
                                                       max_new, kv_blocks, log)
        print(text)
    env["load_average_at_end"] = load_average()
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
    print(f"\nload average (1, 5, 15 min): {format_load(load_at_start)} at start, "
          f"{format_load(env['load_average_at_end'])} at end, on {os.cpu_count()} CPUs")
    print(f"wrote {json_path} and {png_path}")
    return 0
