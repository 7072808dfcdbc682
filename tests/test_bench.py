"""`specdec bench` end to end on tiny random checkpoints, plus the formula and ratio math."""
from __future__ import annotations

import json
import math
import random

import pytest

from specdec.app.bench.report import annotate, evaluate_targets
from specdec.app.bench.runners import RunResult, left_pad
from specdec.app.bench.theory import expected_tokens_per_round, theoretical_speedup

from checkpoints import CONFIGS, build_checkpoint, perturbed_copy


def test_theoretical_speedup_formula():
    a, k, c = 0.7, 4, 0.1
    assert theoretical_speedup(a, k, c) == pytest.approx((1 - a ** 5) / ((1 - a) * (k * c + 1)))
    assert expected_tokens_per_round(0.0, 5) == 1.0
    assert expected_tokens_per_round(1.0, 5) == 6.0  # the a -> 1 limit
    assert theoretical_speedup(1.0, 3, 0.0) == 4.0
    assert theoretical_speedup(0.0, 3, 0.5) == pytest.approx(1 / 2.5)
    assert math.isclose(expected_tokens_per_round(1 - 1e-9, 4), 5.0, rel_tol=1e-6)
    with pytest.raises(ValueError):
        theoretical_speedup(1.5, 3, 0.1)


def test_ratios_and_targets():
    def row(system, tps, batch=1, mode="greedy", k=None, acc=None):
        return RunResult(system=system, label=system, batch=batch, mode=mode, k=k, prompts=8, tokens=100,
                         seconds=100 / tps, tokens_per_s=tps, acceptance_rate=acc, target_forward_passes=50)

    rows = [row("engine", 100.0), row("spec-draft", 180.0, k=5, acc=0.7), row("spec-ngram", 120.0, k=5, acc=0.3),
            row("hf", 40.0), row("hf-assisted", 100.0, k=5), row("engine", 300.0, batch=8), row("hf", 150.0, batch=8)]
    rows[2].draft_seconds = 0.0
    costs = {"by_batch": {"1": {"target_step_s": 0.01, "c": 0.1}, "8": {"target_step_s": 0.02, "c": 0.2}}}
    annotate(rows, costs)
    spec = rows[1]
    assert spec.vs_engine_plain == pytest.approx(1.8)
    assert spec.vs_hf_plain == pytest.approx(4.5)
    assert spec.vs_hf_assisted == pytest.approx(1.8)
    assert spec.cost_ratio_c == 0.1
    assert spec.theoretical_speedup == pytest.approx(theoretical_speedup(0.7, 5, 0.1))
    assert rows[2].cost_ratio_c == 0.0
    assert rows[2].theoretical_speedup == pytest.approx(expected_tokens_per_round(0.3, 5))
    assert rows[0].vs_hf_plain == pytest.approx(2.5)
    assert rows[5].vs_hf_plain == pytest.approx(2.0)  # batch 8 compares with batch 8
    status = {t["target"]: (t["status"], t["measured"]) for t in evaluate_targets(rows)}
    assert status["draft acceptance >= 0.6"] == ("PASS", 0.7)
    assert status["spec >= 1.6x plain"][0] == "PASS"
    assert status["plain >= 2x HF"][0] == "PASS"
    assert status["spec >= 1.5x HF assisted"][0] == "PASS"


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_bench_end_to_end(tmp_path, capsys):
    from specdec.app.cli import main

    target = build_checkpoint(tmp_path / "target", seed=0, **CONFIGS["gqa_untied"])
    draft = perturbed_copy(target, tmp_path / "draft", noise=0.05)
    rng = random.Random(0)
    prompts = tmp_path / "prompts.jsonl"
    with prompts.open("w") as f:
        for _ in range(4):
            f.write(json.dumps({"prompt_ids": [rng.randrange(300) for _ in range(6)] * 2}) + "\n")
    out = tmp_path / "out"
    rc = main(["bench", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts), "--quick",
               "--max-new-tokens", "6", "--threads", "1", "--cost-steps", "3", "--sweep-k", "1,2",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "targets (batch 1, greedy)" in printed and "theory x" in printed
    data = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").stat().st_size > 1000
    assert {"command", "environment", "config", "cost", "results", "sweep", "targets"} <= set(data)
    assert data["environment"]["torch_threads"] == 1 and data["environment"]["parameters"]["target"] > 0
    rows = {(r["system"], r["batch"], r["mode"]): r for r in data["results"]}
    assert len(rows) == 5 * 2 * 2  # systems x batch sizes (1, 2) x modes (greedy, T=0.8)
    assert rows[("hf-assisted", 2, "greedy")]["skipped"]  # HF assisted: batch 1 only
    for key, r in rows.items():
        if r["skipped"]:
            continue
        assert r["tokens"] == 2 * 6, key  # every system generates exactly max_new_tokens per prompt
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        plain = rows[("engine", key[1], key[2])]
        assert r["vs_engine_plain"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"])
        hf = rows[("hf", key[1], key[2])]
        assert r["vs_hf_plain"] == pytest.approx(r["tokens_per_s"] / hf["tokens_per_s"])
    for batch in (1, 2):  # lossless: greedy speculative output is the target's greedy output
        assert rows[("spec-draft", batch, "greedy")]["same_output_as_plain"] == 1.0
        assert rows[("spec-ngram", batch, "greedy")]["same_output_as_plain"] == 1.0
    spec = rows[("spec-draft", 1, "greedy")]
    assert 0.0 <= spec["acceptance_rate"] <= spec["alpha"] <= 1.0  # untested tokens only lower accepted/proposed
    assert spec["theoretical_speedup"] == pytest.approx(
        theoretical_speedup(spec["alpha"], 5, data["cost"]["by_batch"]["1"]["c"]))
    assert sorted((r["system"], r["k"]) for r in data["sweep"]) == [
        ("spec-draft", 1), ("spec-draft", 2), ("spec-ngram", 1), ("spec-ngram", 2)]
    assert [t["status"] in ("PASS", "MISS") for t in data["targets"]] == [True] * 4
