"""scripts/round_log.py: a row per round of an adaptive run, and its summary by K."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from round_log import summary  # noqa: E402


def row(k: list[int], predicted: float | None, measured: float, committed: int, prefill: bool = False,
        settled: bool = False) -> dict:
    return {"k": k, "predicted_s": predicted, "measured_s": measured, "expected": 1.0 + sum(k) / 2,
            "committed": committed, "prefill": prefill, "settled": settled}


def test_the_summary_groups_rounds_by_their_largest_k_and_keeps_prompt_rounds_apart():
    rows = [row([0], None, 0.010, 1, prefill=True), row([0], 0.002, 0.002, 1), row([0], 0.002, 0.004, 1, settled=True),
            row([2, 0], 0.005, 0.006, 3), row([0, 2], 0.007, 0.008, 4)]
    lines = summary(rows)
    assert lines[2:] == ["| 0 | no | 2 | 1 | 2.00 | 3.00 | 1.00 | 1.00 |",
                         "| 0 | yes | 1 | 0 | - | 10.00 | 1.00 | 1.00 |",
                         "| 2 | no | 2 | 0 | 6.00 | 7.00 | 2.00 | 3.50 |"]


@pytest.mark.parametrize("trees", [[], ["--tree-branches", "2", "--tree-side-depth", "1"]], ids=["chains", "trees"])
def test_the_script_logs_every_round_of_a_run_on_the_shipped_pair(tmp_path, trees):
    out = tmp_path / "rounds.jsonl"
    run = subprocess.run([sys.executable, str(ROOT / "scripts/round_log.py"), "--count", "2", "--new-tokens", "12",
                          "--out", str(out), *trees], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| K | prefill | rounds |" in run.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sum(r["committed"] for r in rows) == 2 * 12  # every round, every token (EOS ignored)
    assert sum(r["prefill"] for r in rows) == 2  # one prompt at a time
    assert all(r["measured_s"] > 0 and len(r["k"]) == r["requests"] == 1 for r in rows)
    # priced from the round after the first that the verify fit counts (not the prompt's round,
    # nor the cold one after it: round_costs); a round that fed a prompt never
    assert all((r["predicted_s"] is None) == (r["prefill"] or i < 3) for i, r in enumerate(rows))
    assert all(r["accepted"] <= r["proposed"] <= sum(r["k"]) for r in rows)
    # a chain (side depth 0), or with trees the other children as leaves beside a drafted depth
    assert all(side <= (min(k, 1) if trees else 0) for r in rows for k, side in zip(r["k"], r["side"]))
