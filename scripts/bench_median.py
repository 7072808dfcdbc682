"""Median of several `specdec bench` runs, as a Markdown table.

    python scripts/bench_median.py bench_out1/bench.json bench_out2/bench.json bench_out3/bench.json

Per row (prompt set, system, batch, mode): the median tokens/s and the median of each run's
ratio to specdec plain and to HF generate measured in the same run, plus the spread of the ratio
to plain; for speculative rows also the median mean K and share of theory, when the runs have them.
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

# Runs from before prompt sets existed name no set on their rows: their set is their prompts file's.
SET_OF_FILE = {"heldout_prompts": "code", "prose_prompts": "prose"}


def rows_of(path: str) -> list[dict]:
    """The measured rows of one bench.json, each with its prompt set."""
    data = json.loads(Path(path).read_text())
    stem = Path(data.get("config", {}).get("prompts_file") or "heldout_prompts").stem
    rows = []
    for r in data["results"]:
        if r.get("tokens_per_s"):
            rows.append({**r, "prompt_set": r.get("prompt_set") or SET_OF_FILE.get(stem, stem)})
    return rows


def _median(runs: list[dict], field: str) -> float | None:
    values = [r[field] for r in runs if r.get(field) is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for path in paths:
        for r in rows_of(path):
            cells[(r["prompt_set"], r["label"], r["batch"], r["mode"])].append(r)
    every_row = [r for runs in cells.values() for r in runs]
    # Columns that no run has (bench.json from before adaptive K) are left out rather than all "-".
    optional = [(field, head, spec, suffix, scale) for field, head, spec, suffix, scale in [
        ("mean_k", "mean K", ".2f", "", 1.0), ("share_of_theory", "% of theory", ".0f", "%", 100.0)]
        if any(r.get(field) is not None for r in every_row)]
    head = ["prompts", "system", "batch", "mode", "tok/s", "x specdec plain (min-max)", "x HF plain"]
    head += [h for _, h, _, _, _ in optional] + ["runs"]
    print(f"median of {len(paths)} runs\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for (prompt_set, label, batch, mode), runs in cells.items():
        ratios = [r["vs_engine_plain"] for r in runs if r.get("vs_engine_plain") is not None]
        ratio = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
        row = [prompt_set, label, str(batch), mode, _fmt(_median(runs, "tokens_per_s"), ".1f"), ratio,
               _fmt(_median(runs, "vs_hf_plain"), ".2f")]
        for field, _, spec, suffix, scale in optional:
            value = _median(runs, field)
            row.append(_fmt(None if value is None else value * scale, spec, suffix))
        row.append(str(len(runs)))
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
