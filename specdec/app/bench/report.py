"""Ratios, expected speedups, the printed table, the targets, and the JSON/PNG outputs."""
from __future__ import annotations

import json
from pathlib import Path

from specdec.app.bench.runners import RunResult
from specdec.app.bench.theory import expected_tokens_per_round, theoretical_speedup

# (name, what is measured, threshold)
TARGETS = [
    ("draft acceptance >= 0.6", "greedy acceptance rate of the draft model, batch 1, held-out prompts", 0.6),
    ("spec >= 1.6x plain", "specdec + draft vs specdec plain, tokens/s, batch 1 greedy", 1.6),
    ("plain >= 2x HF", "specdec plain vs HF generate, tokens/s, batch 1 greedy", 2.0),
    ("spec >= 1.5x HF assisted", "specdec + draft vs HF assisted generation, tokens/s, batch 1 greedy", 1.5),
]


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _find(results: list[RunResult], system: str, batch: int, mode: str) -> RunResult | None:
    for r in results:
        if r.system == system and r.batch == batch and r.mode == mode and r.skipped is None:
            return r
    return None


def cost_ratio(result: RunResult, costs: dict | None) -> float | None:
    """c for this run: the measured draft/target step cost (model draft), or for the n-gram
    drafter its in-run lookup time per drafted position over a target step."""
    if costs is None or result.k is None:
        return None
    entry = costs.get("by_batch", {}).get(str(result.batch))
    if entry is None:
        return None
    if result.system == "spec-ngram":
        if not result.target_forward_passes or not result.k or result.draft_seconds is None:
            return None
        rounds = result.target_forward_passes / max(1, min(result.batch, result.prompts))
        return result.draft_seconds / rounds / result.k / entry["target_step_s"]
    return entry.get("c")


def annotate(results: list[RunResult], costs: dict | None, baselines: list[RunResult] | None = None) -> None:
    """Fill in ratios to the baselines at the same batch and mode, c, and the theoretical speedup."""
    pool = list(baselines or []) + list(results)
    for r in results:
        if r.skipped is not None:
            continue
        plain = _find(pool, "engine", r.batch, r.mode)
        hf = _find(pool, "hf", r.batch, r.mode)
        r.vs_engine_plain = _ratio(r.tokens_per_s, plain.tokens_per_s if plain else None)
        r.vs_hf_plain = _ratio(r.tokens_per_s, hf.tokens_per_s if hf else None)
        if r.system == "spec-draft":
            assisted = _find(pool, "hf-assisted", r.batch, r.mode)
            r.vs_hf_assisted = _ratio(r.tokens_per_s, assisted.tokens_per_s if assisted else None)
        if r.mode == "greedy" and plain is not None and r.outputs and len(plain.outputs) == len(r.outputs):
            r.same_output_as_plain = sum(a == b for a, b in zip(r.outputs, plain.outputs)) / len(r.outputs)
        a = r.alpha if r.alpha is not None else r.acceptance_rate
        if r.system in ("spec-draft", "spec-ngram") and a is not None:
            r.cost_ratio_c = cost_ratio(r, costs)
            if r.cost_ratio_c is not None and r.k is not None:
                r.theoretical_speedup = theoretical_speedup(a, r.k, r.cost_ratio_c)
                entry = (costs or {}).get("by_batch", {}).get(str(r.batch), {})
                if "verify_pass_over_step" in entry:
                    # The formula prices a K+1-token verify pass like a 1-token step; with the
                    # measured price of that pass instead:
                    r.theoretical_speedup_with_verify_cost = (
                        expected_tokens_per_round(a, r.k) / (r.k * r.cost_ratio_c + entry["verify_pass_over_step"]))


def evaluate_targets(results: list[RunResult]) -> list[dict]:
    spec = _find(results, "spec-draft", 1, "greedy")
    plain = _find(results, "engine", 1, "greedy")
    values = [
        spec.acceptance_rate if spec else None,
        spec.vs_engine_plain if spec else None,
        plain.vs_hf_plain if plain else None,
        spec.vs_hf_assisted if spec else None,
    ]
    out = []
    for (name, what, threshold), value in zip(TARGETS, values):
        status = "n/a" if value is None else ("PASS" if value >= threshold else "MISS")
        out.append({"target": name, "measured": value, "threshold": threshold, "status": status, "what": what})
    return out


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) + suffix


def format_table(results: list[RunResult], sweep: bool = False) -> str:
    head = ["system", "batch", "mode", "K", "tokens", "sec", "tok/s", "x plain", "x HF", "x HF-asst",
            "accept", "alpha", "mean len", "c", "theory x", "=plain"]
    rows = []
    for r in results:
        if r.skipped is not None:
            rows.append([r.label, str(r.batch), r.mode, _fmt(r.k, "d"), "-", "-", "n/a", "-", "-", "-",
                         "-", "-", "-", "-", "-", "-"])
            continue
        rows.append([r.label, str(r.batch), r.mode, _fmt(r.k, "d"), str(r.tokens), _fmt(r.seconds, ".1f"),
                     _fmt(r.tokens_per_s, ".1f"), _fmt(r.vs_engine_plain, ".2f", "x"), _fmt(r.vs_hf_plain, ".2f", "x"),
                     _fmt(r.vs_hf_assisted, ".2f", "x"), _fmt(r.acceptance_rate, ".3f"), _fmt(r.alpha, ".3f"),
                     _fmt(r.mean_accepted_length, ".2f"), _fmt(r.cost_ratio_c, ".3f"),
                     _fmt(r.theoretical_speedup, ".2f", "x"), _fmt(r.same_output_as_plain, ".0%")])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) if i < 3 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    notes = sorted({f"{r.label}, batch {r.batch}: n/a ({r.skipped})" for r in results if r.skipped})
    if notes:
        lines += [""] + notes
    return "\n".join(lines)


def format_breakdown(results: list[RunResult]) -> str:
    """Where specdec's wall time went: draft worker, target worker, everything else."""
    lines = ["specdec time breakdown (share of wall time):",
             f"  {'system':<24}{'batch':>6}  {'mode':<7}{'draft':>8}{'verify':>8}{'other':>8}{'ms/pass':>9}"]
    for r in results:
        if r.skipped or r.verify_seconds is None or not r.seconds:
            continue
        passes = r.target_forward_passes / max(1, min(r.batch, r.prompts)) if r.target_forward_passes else 0
        ms = 1000 * r.verify_seconds / passes if passes else None
        lines.append(f"  {r.label:<24}{r.batch:>6}  {r.mode:<7}{r.draft_seconds / r.seconds:>8.1%}"
                     f"{r.verify_seconds / r.seconds:>8.1%}{r.other_seconds / r.seconds:>8.1%}{_fmt(ms, '.2f'):>9}")
    return "\n".join(lines)


def format_costs(costs: dict | None) -> str:
    if not costs:
        return "cost ratio c: not measured"
    lines = ["step costs in specdec's runtime (median of one forward pass at the prompts' context length):"]
    for b, e in costs["by_batch"].items():
        line = (f"  batch {b}: target step {1000 * e['target_step_s']:.2f} ms, "
                f"{e['verify_tokens']}-token verify pass {1000 * e['target_verify_pass_s']:.2f} ms "
                f"({e['verify_pass_over_step']:.2f}x a step)")
        if "c" in e:
            line += f", draft step {1000 * e['draft_step_s']:.2f} ms -> c = {e['c']:.3f}"
        lines.append(line)
    return "\n".join(lines)


def format_targets(targets: list[dict]) -> str:
    lines = ["targets (batch 1, greedy):"]
    for t in targets:
        value = "-" if t["measured"] is None else (f"{t['measured']:.3f}" if "acceptance" in t["target"]
                                                   else f"{t['measured']:.2f}x")
        lines.append(f"  [{t['status']:>4}] {t['target']:<26} measured {value:>8}   ({t['what']})")
    return "\n".join(lines)


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def write_plot(path: Path, results: list[RunResult], sweep: list[RunResult], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in results if r.skipped is None and r.tokens_per_s]
    panels = (1 if measured else 0) + (1 if sweep else 0)
    fig, axes = plt.subplots(1, max(1, panels), figsize=(7.5 * max(1, panels), 4.8), squeeze=False)
    axes = list(axes[0])
    if measured:
        ax = axes.pop(0)
        groups = []
        for r in results:
            key = (r.batch, r.mode)
            if key not in groups:
                groups.append(key)
        systems = []
        for r in results:
            if r.system not in systems:
                systems.append(r.system)
        width = 0.8 / max(1, len(systems))
        for j, system in enumerate(systems):
            xs, ys, label = [], [], system
            for i, (batch, mode) in enumerate(groups):
                r = _find(measured, system, batch, mode)
                if r is not None:
                    xs.append(i + (j - (len(systems) - 1) / 2) * width)
                    ys.append(r.tokens_per_s)
                    label = r.label
            bars = ax.bar(xs, ys, width, label=label)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(groups)), [f"batch {b}\n{m}" for b, m in groups])
        ax.set_ylabel("generated tokens / s")
        ax.set_title("throughput (higher is better)")
        ax.legend(fontsize=8)
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
        ax.set_xlabel("K (draft tokens per round)")
        ax.set_ylabel("speedup over specdec plain")
        ax.set_title(f"K sweep (batch {sweep[0].batch}, {sweep[0].mode})")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
