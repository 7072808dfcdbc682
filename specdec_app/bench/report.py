"""Ratios, expected speedups, the printed table, the targets, and the JSON/PNG outputs.

Every comparison (x plain, x HF, x HF-asst, =plain) is between rows of the same prompt set,
batch size and mode.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdec_app.bench.results import SPECULATIVE_SYSTEMS, SYSTEMS, RunResult
from specdec_app.bench.theory import best_fixed_k_speedup, expected_tokens_per_round, theoretical_speedup


@dataclass(frozen=True)
class Target:
    """A release target: the worst `measure` over the rows it covers must reach `threshold`."""

    name: str
    what: str
    threshold: float
    systems: tuple[str, ...]
    measure: str  # a RunResult field: "vs_engine_plain", "vs_hf_plain" or "share_of_theory"
    prompt_set: str | None = None  # None: every prompt set
    batch: int | None = None  # None: every batch size
    mode: str | None = None  # None: every mode


def _code_draft_vs_plain(threshold: float, batch: int, mode: str) -> Target:
    return Target(f"code: draft >= {threshold:g}x plain, b{batch} {mode}",
                  f"specdec + draft (adaptive) vs specdec plain, tokens/s, code prompts, batch {batch}, {mode}",
                  threshold, ("spec-draft",), "vs_engine_plain", "code", batch, mode)


# What this release is measured against (the policy's own target, adaptive >= 0.95x the best of
# plain and every fixed K, is --oracle's and `specdec bench-policy`'s).
TARGETS = [
    _code_draft_vs_plain(1.6, 1, "greedy"),
    Target("spec >= 0.95x plain, worst row", "specdec + draft and + n-gram (adaptive) vs specdec plain, "
           "tokens/s, every prompt set, batch and mode", 0.95, ("spec-draft", "spec-ngram"), "vs_engine_plain"),
    Target("plain >= 1.0x HF, worst row", "specdec plain vs HF generate, tokens/s, every prompt set, batch and mode",
           1.0, ("engine",), "vs_hf_plain"),
]


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _find(results: list[RunResult], system: str, batch: int, mode: str, prompt_set: str) -> RunResult | None:
    for r in results:
        if (r.system == system and r.batch == batch and r.mode == mode and r.prompt_set == prompt_set
                and r.skipped is None):
            return r
    return None


def prompt_sets_of(results: list[RunResult]) -> list[str]:
    """The prompt sets of these rows, in the order they first appear."""
    return list(dict.fromkeys(r.prompt_set for r in results))


def cost_ratio(result: RunResult, costs: dict | None) -> float | None:
    """c for this run: the measured draft/target step cost (model draft), or for the n-gram
    drafter its in-run lookup time per draft step over a target step. `costs`: the step-cost
    measurement of the run's prompt set."""
    if costs is None or result.k is None:
        return None
    entry = costs.get("by_batch", {}).get(str(result.batch))
    if entry is None:
        return None
    if SYSTEMS[result.system].drafter == "ngram":
        if result.draft_seconds is None:
            return None
        if result.draft_steps is not None:
            steps = result.draft_steps
        else:  # rows without a K tally: assume every round drafted K (fixed K)
            rounds = (result.target_forward_passes or 0) / max(1, min(result.batch, result.prompts))
            steps = rounds * result.k
        return result.draft_seconds / steps / entry["target_step_s"] if steps else None
    return entry.get("c")


def annotate(results: list[RunResult], costs_by_set: dict[str, dict] | None,
             baselines: list[RunResult] | None = None) -> None:
    """Fill in ratios to the baselines of the same prompt set, batch and mode, c, the theoretical
    speedup and the measured share of it. `costs_by_set`: prompt set -> step-cost measurement."""
    pool = list(baselines or []) + list(results)
    for r in results:
        if r.skipped is not None:
            continue
        plain = _find(pool, "engine", r.batch, r.mode, r.prompt_set)
        hf = _find(pool, "hf", r.batch, r.mode, r.prompt_set)
        r.vs_engine_plain = _ratio(r.tokens_per_s, plain.tokens_per_s if plain else None)
        r.vs_hf_plain = _ratio(r.tokens_per_s, hf.tokens_per_s if hf else None)
        if SYSTEMS[r.system].drafter == "model":
            assisted = _find(pool, "hf-assisted", r.batch, r.mode, r.prompt_set)
            r.vs_hf_assisted = _ratio(r.tokens_per_s, assisted.tokens_per_s if assisted else None)
        if r.mode == "greedy" and plain is not None and r.outputs and len(plain.outputs) == len(r.outputs):
            r.same_output_as_plain = sum(a == b for a, b in zip(r.outputs, plain.outputs)) / len(r.outputs)
        a = r.alpha if r.alpha is not None else r.acceptance_rate
        if r.system not in SPECULATIVE_SYSTEMS or a is None or not r.k:
            continue
        costs = (costs_by_set or {}).get(r.prompt_set)
        r.cost_ratio_c = cost_ratio(r, costs)
        if r.cost_ratio_c is None:
            continue
        if SYSTEMS[r.system].adaptive:
            # K varies per round; the reference is the best K the run could have fixed instead.
            r.theoretical_speedup, r.theory_k = best_fixed_k_speedup(a, r.k, r.cost_ratio_c)
        else:
            r.theoretical_speedup, r.theory_k = theoretical_speedup(a, r.k, r.cost_ratio_c), r.k
        r.share_of_theory = _ratio(r.vs_engine_plain, r.theoretical_speedup)
        entry = (costs or {}).get("by_batch", {}).get(str(r.batch), {})
        if entry.get("verify_tokens") == r.theory_k + 1:
            # The formula prices a K+1-token verify pass like a 1-token step; with the measured
            # price of that pass instead (measured for the cap K only):
            r.theoretical_speedup_with_verify_cost = (
                expected_tokens_per_round(a, r.theory_k)
                / (r.theory_k * r.cost_ratio_c + entry["verify_pass_over_step"]))


def _describe(r: RunResult) -> str:
    return f"{r.system}, {r.prompt_set} prompts, batch {r.batch}, {r.mode}"


def evaluate_targets(results: list[RunResult]) -> list[dict]:
    """Each target's worst measured value over the rows it covers; n/a when it covers none."""
    out = []
    for target in TARGETS:
        rows = [r for r in results
                if r.skipped is None and r.system in target.systems
                and target.prompt_set in (None, r.prompt_set) and target.batch in (None, r.batch)
                and target.mode in (None, r.mode) and getattr(r, target.measure) is not None]
        worst = min(rows, key=lambda r: getattr(r, target.measure)) if rows else None
        value = getattr(worst, target.measure) if worst else None
        status = "n/a" if value is None else ("PASS" if value >= target.threshold else "MISS")
        out.append({"target": target.name, "measured": value, "threshold": target.threshold, "status": status,
                    "what": target.what, "prompt_set": target.prompt_set, "measure": target.measure,
                    "rows": len(rows), "worst_row": _describe(worst) if worst else None})
    return out


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) + suffix


TABLE_HEAD = ["system", "batch", "mode", "K", "tokens", "sec", "tok/s", "x plain", "x HF", "x HF-asst", "accept",
              "alpha", "mean len", "mean K", "K=0", "c", "theory x", "% theory", "=plain"]


def _table_row(r: RunResult) -> list[str]:
    if r.skipped is not None:
        return [r.label, str(r.batch), r.mode, _fmt(r.k, "d"), "-", "-", "n/a"] + ["-"] * (len(TABLE_HEAD) - 7)
    return [r.label, str(r.batch), r.mode, _fmt(r.k, "d"), str(r.tokens), _fmt(r.seconds, ".1f"),
            _fmt(r.tokens_per_s, ".1f"), _fmt(r.vs_engine_plain, ".2f", "x"), _fmt(r.vs_hf_plain, ".2f", "x"),
            _fmt(r.vs_hf_assisted, ".2f", "x"), _fmt(r.acceptance_rate, ".3f"), _fmt(r.alpha, ".3f"),
            _fmt(r.mean_accepted_length, ".2f"), _fmt(r.mean_k, ".2f"), _fmt(r.share_k0, ".0%"),
            _fmt(r.cost_ratio_c, ".3f"), _fmt(r.theoretical_speedup, ".2f", "x"), _fmt(r.share_of_theory, ".0%"),
            _fmt(r.same_output_as_plain, ".0%")]


def format_table(results: list[RunResult]) -> str:
    """One table per prompt set (headed by its name when there are several), aligned alike."""
    rows = [_table_row(r) for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(TABLE_HEAD)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    sets = prompt_sets_of(results)
    lines = []
    for prompt_set in sets:
        if len(sets) > 1:
            lines += ([""] if lines else []) + [f"prompt set {prompt_set}:"]
        lines += [line(TABLE_HEAD), "  ".join("-" * w for w in widths)]
        lines += [line(row) for r, row in zip(results, rows) if r.prompt_set == prompt_set]
    notes = sorted({f"{r.label}, batch {r.batch}: n/a ({r.skipped})" for r in results if r.skipped})
    if notes:
        lines += [""] + notes
    return "\n".join(lines)


def format_breakdown(results: list[RunResult]) -> str:
    """Where specdec's wall time went: draft worker, target worker, everything else."""
    width = max([len(r.label) for r in results] + [6]) + 2
    set_width = max([len(r.prompt_set) for r in results] + [7]) + 2
    lines = ["specdec time breakdown (share of wall time):",
             f"  {'prompts':<{set_width}}{'system':<{width}}{'batch':>5}  {'mode':<7}"
             f"{'draft':>8}{'verify':>8}{'other':>8}{'ms/pass':>9}"]
    for r in results:
        if r.skipped or r.verify_seconds is None or not r.seconds:
            continue
        passes = r.target_forward_passes / max(1, min(r.batch, r.prompts)) if r.target_forward_passes else 0
        ms = 1000 * r.verify_seconds / passes if passes else None
        lines.append(f"  {r.prompt_set:<{set_width}}{r.label:<{width}}{r.batch:>5}  {r.mode:<7}"
                     f"{r.draft_seconds / r.seconds:>8.1%}{r.verify_seconds / r.seconds:>8.1%}"
                     f"{r.other_seconds / r.seconds:>8.1%}{_fmt(ms, '.2f'):>9}")
    return "\n".join(lines)


def format_depths(results: list[RunResult]) -> str:
    """Chains and trees side by side: draft tokens verified per target pass, acceptance per depth."""
    rows = [r for r in results if not r.skipped and r.nodes_per_pass is not None]
    if not rows:
        return ""
    width = max(len(r.label) for r in rows) + 2
    set_width = max([len(r.prompt_set) for r in rows] + [7]) + 2
    lines = ["draft tokens verified per target pass, the share of drafts that were trees, and acceptance at"
             " each depth (accepted / tested):",
             f"  {'prompts':<{set_width}}{'system':<{width}}{'batch':>5}  {'mode':<7}{'nodes':>7}{'trees':>7}"
             "  by depth"]
    for r in rows:
        depths = " ".join(f"{a:.2f}" for a in r.acceptance_by_depth or [])
        lines.append(f"  {r.prompt_set:<{set_width}}{r.label:<{width}}{r.batch:>5}  {r.mode:<7}"
                     f"{r.nodes_per_pass:>7.2f}{_fmt(r.tree_share, '.0%'):>7}  {depths}")
    return "\n".join(lines)


def format_costs(costs_by_set: dict[str, dict] | None) -> str:
    if not costs_by_set:
        return "cost ratio c: not measured"
    lines = ["step costs in specdec's runtime (median of one forward pass at the prompts' context length):"]
    for prompt_set, costs in costs_by_set.items():
        for b, e in costs["by_batch"].items():
            line = (f"  {prompt_set}, batch {b}: target step {1000 * e['target_step_s']:.2f} ms, "
                    f"{e['verify_tokens']}-token verify pass {1000 * e['target_verify_pass_s']:.2f} ms "
                    f"({e['verify_pass_over_step']:.2f}x a step)")
            if "c" in e:
                line += f", draft step {1000 * e['draft_step_s']:.2f} ms -> c = {e['c']:.3f}"
            lines.append(line)
    return "\n".join(lines)


def format_targets(targets: list[dict]) -> str:
    lines = ["targets (a target over several rows reports its worst one):"]
    width = max(len(t["target"]) for t in targets) if targets else 0
    for t in targets:
        if t["measured"] is None:
            value = "-"
        elif t["measure"] == "share_of_theory":
            value = f"{t['measured']:.0%}"
        else:
            value = f"{t['measured']:.2f}x"
        where = f"; worst: {t['worst_row']}" if t["worst_row"] and t["rows"] > 1 else ""
        lines.append(f"  [{t['status']:>4}] {t['target']:<{width}}  measured {value:>6}   ({t['what']}{where})")
    return "\n".join(lines)


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def write_plot(path: Path, results: list[RunResult], sweep: list[RunResult], title: str) -> None:
    """One throughput panel per prompt set, and the K sweep when there is one."""
    import matplotlib  # deferred: heavy, and needed only for the plot at the end of a run

    matplotlib.use("Agg")  # before pyplot is imported: no display here
    import matplotlib.pyplot as plt

    measured = [r for r in results if r.skipped is None and r.tokens_per_s]
    sets = prompt_sets_of(measured)
    panels = len(sets) + (1 if sweep else 0)
    fig, axes = plt.subplots(1, max(1, panels), figsize=(7.5 * max(1, panels), 4.8), squeeze=False)
    axes = list(axes[0])
    systems = list(dict.fromkeys(r.system for r in results))
    legend = {}
    for prompt_set in sets:
        ax = axes.pop(0)
        groups = list(dict.fromkeys((r.batch, r.mode) for r in results if r.prompt_set == prompt_set))
        width = 0.8 / max(1, len(systems))
        for j, system in enumerate(systems):
            xs, ys, label = [], [], SYSTEMS[system].label
            for i, (batch, mode) in enumerate(groups):
                r = _find(measured, system, batch, mode, prompt_set)
                if r is not None:
                    xs.append(i + (j - (len(systems) - 1) / 2) * width)
                    ys.append(r.tokens_per_s)
            bars = ax.bar(xs, ys, width, label=label, color=f"C{j}")
            ax.bar_label(bars, fmt="%.0f", fontsize=6)
            legend.setdefault(label, bars)
        ax.set_xticks(range(len(groups)), [f"batch {b}\n{m}" for b, m in groups])
        ax.set_ylabel("generated tokens / s")
        ax.set_title(f"throughput, {prompt_set} prompts (higher is better)")
    if sweep:
        ax = axes.pop(0)
        for system in dict.fromkeys(r.system for r in sweep):
            rows = sorted((r for r in sweep if r.system == system and r.skipped is None), key=lambda r: r.k)
            if not rows:
                continue
            line, = ax.plot([r.k for r in rows], [r.vs_engine_plain for r in rows], "o-",
                            label=f"{rows[0].label} measured")
            theory = [(r.k, r.theoretical_speedup) for r in rows if r.theoretical_speedup is not None]
            if theory:
                ax.plot(*zip(*theory), "x--", color=line.get_color(), label=f"{rows[0].label} theory")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(sorted({r.k for r in sweep if r.k is not None}))
        ax.set_xlabel("K (draft tokens per round; adaptive: the most per round)")
        ax.set_ylabel("speedup over specdec plain")
        ax.set_title(f"K sweep ({sweep[0].prompt_set} prompts, batch {sweep[0].batch}, {sweep[0].mode})")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    if legend:  # one legend for every throughput panel, below them, so it hides no bar
        fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=min(len(legend), 4), fontsize=8)
    fig.tight_layout(rect=(0, 0.06 * ((len(legend) + 3) // 4), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
