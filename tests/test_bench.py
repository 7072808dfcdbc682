"""`specdec bench` end to end on tiny random checkpoints, plus the formula, ratio and target math."""
from __future__ import annotations

import json
import math
import random

import pytest

from specdec_app.bench.hf_runner import left_pad
from specdec_app.bench.report import TARGETS, annotate, evaluate_targets
from specdec_app.bench.results import RunResult, pool_runs
from specdec_app.bench.theory import best_fixed_k_speedup, expected_tokens_per_round, theoretical_speedup

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


def test_best_fixed_k_speedup():
    # Costly drafting: the best K is inside 1..5, not the cap.
    a, c = 0.7, 0.3
    by_k = {k: theoretical_speedup(a, k, c) for k in range(1, 6)}
    best_k = max(by_k, key=by_k.get)
    assert 1 < best_k < 5
    assert best_fixed_k_speedup(a, 5, c) == (pytest.approx(by_k[best_k]), best_k)
    assert best_fixed_k_speedup(0.9, 5, 0.0) == (pytest.approx(theoretical_speedup(0.9, 5, 0.0)), 5)  # free drafts
    assert best_fixed_k_speedup(0.0, 5, 0.1) == (pytest.approx(1 / 1.1), 1)  # all bad: the cheapest K >= 1
    with pytest.raises(ValueError):
        best_fixed_k_speedup(0.5, 0, 0.1)


def _row(system, tps, prompt_set="code", batch=1, mode="greedy", k=None, acc=None, alpha=None):
    return RunResult(system=system, label=system, batch=batch, mode=mode, k=k, prompt_set=prompt_set, prompts=8,
                     tokens=100, seconds=100 / tps, tokens_per_s=tps, acceptance_rate=acc, alpha=alpha,
                     target_forward_passes=50)


def test_ratios_and_theory():
    rows = [_row("engine", 100.0), _row("spec-draft", 180.0, k=5, acc=0.6, alpha=0.7),
            _row("spec-draft-fixed", 170.0, k=5, acc=0.6, alpha=0.7), _row("spec-ngram", 120.0, k=5, acc=0.3),
            _row("spec-ngram-fixed", 110.0, k=5, acc=0.3), _row("hf", 40.0), _row("hf-assisted", 100.0, k=5),
            _row("engine", 300.0, batch=8), _row("hf", 150.0, batch=8),
            # The same systems on another prompt set, at other speeds: ratios must not cross sets.
            _row("engine", 50.0, "prose"), _row("spec-draft", 60.0, "prose", k=5, acc=0.3, alpha=0.4),
            _row("hf", 25.0, "prose"), _row("hf-assisted", 40.0, "prose", k=5)]
    rows[3].draft_seconds = rows[4].draft_seconds = 0.0
    costs = {"by_batch": {"1": {"target_step_s": 0.01, "c": 0.3, "verify_tokens": 6, "verify_pass_over_step": 1.5},
                          "8": {"target_step_s": 0.02, "c": 0.2}}}
    annotate(rows, {"code": costs, "prose": costs})
    spec, fixed = rows[1], rows[2]
    assert spec.vs_engine_plain == pytest.approx(1.8)
    assert spec.vs_hf_plain == pytest.approx(4.5)
    assert spec.vs_hf_assisted == pytest.approx(1.8)
    assert fixed.vs_hf_assisted == pytest.approx(1.7)
    assert spec.cost_ratio_c == fixed.cost_ratio_c == 0.3
    # Fixed K: the formula at K. Adaptive: the best fixed K under the cap (here not the cap).
    assert fixed.theoretical_speedup == pytest.approx(theoretical_speedup(0.7, 5, 0.3)) and fixed.theory_k == 5
    best, best_k = best_fixed_k_speedup(0.7, 5, 0.3)
    assert best_k < 5 and best > fixed.theoretical_speedup
    assert spec.theoretical_speedup == pytest.approx(best) and spec.theory_k == best_k
    assert spec.share_of_theory == pytest.approx(1.8 / best)
    assert fixed.share_of_theory == pytest.approx(1.7 / theoretical_speedup(0.7, 5, 0.3))
    # The verify pass was measured with K + 1 tokens: priced in for the row whose theory is at K only.
    assert fixed.theoretical_speedup_with_verify_cost == pytest.approx(
        expected_tokens_per_round(0.7, 5) / (5 * 0.3 + 1.5))
    assert spec.theoretical_speedup_with_verify_cost is None
    assert rows[3].cost_ratio_c == 0.0  # the n-gram drafter's c comes from its own lookup time
    assert rows[3].theoretical_speedup == pytest.approx(expected_tokens_per_round(0.3, 5))
    assert rows[0].vs_hf_plain == pytest.approx(2.5)
    assert rows[7].vs_hf_plain == pytest.approx(2.0)  # batch 8 compares with batch 8
    prose_spec = rows[10]
    assert prose_spec.vs_engine_plain == pytest.approx(1.2)  # prose plain (50), not code plain (100)
    assert prose_spec.vs_hf_plain == pytest.approx(2.4) and prose_spec.vs_hf_assisted == pytest.approx(1.5)
    assert rows[9].vs_hf_plain == pytest.approx(2.0)


def test_targets():
    def grid(draft_code: dict, prose: dict, plain_over_hf: float) -> list[RunResult]:
        """specdec plain at 100 tok/s everywhere; HF at 100 / plain_over_hf; spec-draft on code at
        draft_code[(batch, mode)] x plain; adaptive draft and n-gram on prose at prose[...] x plain."""
        rows = []
        for prompt_set in ("code", "prose"):
            for batch in (1, 8):
                for mode in ("greedy", "T=0.8"):
                    rows += [_row("engine", 100.0, prompt_set, batch, mode),
                             _row("hf", 100.0 / plain_over_hf, prompt_set, batch, mode)]
                    if prompt_set == "code":
                        rows.append(_row("spec-draft", 100.0 * draft_code[batch, mode], prompt_set, batch, mode,
                                         k=5, acc=0.7, alpha=0.8))
                    else:
                        rows += [_row(s, 100.0 * prose[s, batch, mode], prompt_set, batch, mode, k=5, acc=0.5,
                                      alpha=0.6) for s in ("spec-draft", "spec-ngram")]
        return rows

    # c = 0 makes the best fixed K the cap: theory = E(0.8, 5) = 3.69; 3.2x is 87% of it.
    costs = {"by_batch": {b: {"target_step_s": 0.01, "c": 0.0} for b in ("1", "8")}}
    good_code = {(1, "greedy"): 3.2, (1, "T=0.8"): 1.3, (8, "greedy"): 1.35, (8, "T=0.8"): 1.1}
    good_prose = {(s, b, m): 1.0 for s in ("spec-draft", "spec-ngram") for b in (1, 8) for m in ("greedy", "T=0.8")}
    rows = grid(good_code, good_prose, plain_over_hf=1.1)
    annotate(rows, {"code": costs, "prose": costs})
    targets = evaluate_targets(rows)
    assert [t["target"] for t in targets] == [t.name for t in TARGETS]
    assert [t["status"] for t in targets] == ["PASS"] * len(TARGETS)

    # One slow prose row, the code row under its bar, HF faster than plain in one place.
    bad_code = {**good_code, (1, "greedy"): 1.5}
    bad_prose = {**good_prose, ("spec-ngram", 8, "T=0.8"): 0.9}
    rows = grid(bad_code, bad_prose, plain_over_hf=1.1)
    next(r for r in rows if r.system == "hf" and r.prompt_set == "prose" and r.batch == 1).tokens_per_s = 125.0
    annotate(rows, {"code": costs, "prose": costs})
    by_name = {t["target"]: t for t in evaluate_targets(rows)}
    status = {name: t["status"] for name, t in by_name.items()}
    assert status == {"code: draft >= 1.6x plain, b1 greedy": "MISS", "spec >= 0.95x plain, worst row": "MISS",
                      "plain >= 1.0x HF, worst row": "MISS"}
    worst = by_name["spec >= 0.95x plain, worst row"]
    assert worst["measured"] == pytest.approx(0.9) and worst["rows"] == 12
    assert worst["worst_row"] == "spec-ngram, prose prompts, batch 8, T=0.8"
    assert by_name["plain >= 1.0x HF, worst row"]["measured"] == pytest.approx(0.8)
    assert by_name["plain >= 1.0x HF, worst row"]["rows"] == 8

    # Rows that are not there: n/a (a run without batch 1 has no b1 target).
    rows = [r for r in grid(good_code, good_prose, 1.1) if r.batch == 8]
    annotate(rows, {"code": costs, "prose": costs})
    status = {t["target"]: t["status"] for t in evaluate_targets(rows)}
    assert status["code: draft >= 1.6x plain, b1 greedy"] == "n/a"
    assert status["spec >= 0.95x plain, worst row"] == "PASS"


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def bench_inputs(tmp_path, num_prompts: int):
    """A tiny random target, a close copy as its draft, and a prompt file of repeating token ids
    named code.jsonl (a --prompts file's set is its stem, so the code targets apply to it)."""
    target = build_checkpoint(tmp_path / "target", seed=0, **CONFIGS["gqa_untied"])
    draft = perturbed_copy(target, tmp_path / "draft", noise=0.05)
    rng = random.Random(0)
    prompts = tmp_path / "code.jsonl"
    with prompts.open("w") as f:
        for _ in range(num_prompts):
            f.write(json.dumps({"prompt_ids": [rng.randrange(300) for _ in range(6)] * 2}) + "\n")
    return target, draft, prompts


def test_bench_end_to_end(tmp_path, capsys):
    from specdec_app.cli import main

    target, draft, prompts = bench_inputs(tmp_path, num_prompts=4)
    out = tmp_path / "out"
    k, max_new = 5, 12  # 12 tokens: room for the adaptive policy to probe after its rounds at K = 0
    rc = main(["bench", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts), "--quick",
               "--max-new-tokens", str(max_new), "--threads", "1", "--cost-steps", "3", "--sweep-k", "1,2",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "targets (" in printed and "theory x" in printed and "% theory" in printed and "mean K" in printed
    assert "load average (1, 5, 15 min)" in printed
    data = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").stat().st_size > 1000
    assert {"command", "environment", "config", "cost", "cost_by_prompt_set", "results", "sweep",
            "targets"} <= set(data)
    assert data["environment"]["torch_threads"] == 1 and data["environment"]["parameters"]["target"] > 0
    assert data["environment"]["load_average_at_end"] is not None
    assert list(data["config"]["prompt_sets"]) == ["code"] and list(data["cost_by_prompt_set"]) == ["code"]
    rows = {(r["system"], r["batch"], r["mode"]): r for r in data["results"]}
    systems = ["engine", "spec-draft", "spec-draft-fixed", "spec-ngram", "spec-ngram-fixed", "hf", "hf-assisted"]
    assert len(data["results"]) == len(rows) == len(systems) * 2 * 2  # x batch sizes (1, 2) x modes
    assert {r["prompt_set"] for r in data["results"]} == {"code"}
    assert rows[("hf-assisted", 2, "greedy")]["skipped"]  # HF assisted: batch 1 only
    for key, r in rows.items():
        if r["skipped"]:
            continue
        assert r["tokens"] == 2 * max_new, key  # every system generates exactly max_new_tokens per prompt
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        plain = rows[("engine", key[1], key[2])]
        assert r["vs_engine_plain"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"])
        hf = rows[("hf", key[1], key[2])]
        assert r["vs_hf_plain"] == pytest.approx(r["tokens_per_s"] / hf["tokens_per_s"])
    for system in ("spec-draft", "spec-draft-fixed", "spec-ngram", "spec-ngram-fixed"):
        for batch in (1, 2):
            # Lossless: greedy speculative output is the target's greedy output, K fixed or chosen.
            assert rows[(system, batch, "greedy")]["same_output_as_plain"] == 1.0, (system, batch)
            for mode in ("greedy", "T=0.8"):
                r = rows[(system, batch, mode)]
                assert r["adaptive"] is (not system.endswith("-fixed")) and r["k"] == k
                histogram = {int(key): n for key, n in r["k_histogram"].items()}
                assert set(histogram) <= set(range(k + 1))
                assert sum(histogram.values()) == r["target_forward_passes"]  # one K per request per round
                assert r["mean_k"] == pytest.approx(sum(n * c for n, c in histogram.items())
                                                    / sum(histogram.values()))
                if not r["adaptive"]:
                    # Always K, except where max_new_tokens caps it: at most K rounds per request.
                    assert histogram[k] > 0
                    assert sum(n for kk, n in histogram.items() if kk < k) <= r["prompts"] * k
    for r in data["results"]:
        if r["system"] in ("engine", "hf", "hf-assisted"):
            assert r["k_histogram"] is None and r["mean_k"] is None
    fixed = rows[("spec-draft-fixed", 1, "greedy")]
    assert 0.0 <= fixed["acceptance_rate"] <= fixed["alpha"] <= 1.0  # untested tokens only lower accepted/proposed
    assert fixed["theoretical_speedup"] == pytest.approx(
        theoretical_speedup(fixed["alpha"], k, data["cost"]["by_batch"]["1"]["c"]))
    assert fixed["share_of_theory"] == pytest.approx(fixed["vs_engine_plain"] / fixed["theoretical_speedup"])
    adaptive = rows[("spec-draft", 1, "greedy")]
    if adaptive["alpha"] is not None:  # it drafted at least once
        assert adaptive["theoretical_speedup"] == pytest.approx(
            best_fixed_k_speedup(adaptive["alpha"], k, data["cost"]["by_batch"]["1"]["c"])[0])
    assert sorted((r["system"], r["k"]) for r in data["sweep"]) == sorted(
        (s, sk) for s in ("spec-draft", "spec-draft-fixed", "spec-ngram", "spec-ngram-fixed") for sk in (1, 2))
    assert {r["prompt_set"] for r in data["sweep"]} == {"code"}
    targets = {t["target"]: t["status"] for t in data["targets"]}
    assert list(targets) == [t.name for t in TARGETS]
    assert set(targets.values()) <= {"PASS", "MISS", "n/a"}
    # Measured here: every target (batch 1 is in the run, code prompts, HF).
    for name in ("code: draft >= 1.6x plain, b1 greedy", "spec >= 0.95x plain, worst row",
                 "plain >= 1.0x HF, worst row"):
        assert targets[name] in ("PASS", "MISS"), name


def test_repeated_runs_pool_into_one_row():
    """--repeats: a row's runs become one result whose rates come from the summed counts."""
    def run(tokens, seconds, proposed, accepted, tested, histogram, passes):
        return RunResult(system="spec-draft", label="x", batch=1, mode="greedy", k=2, tokens=tokens, seconds=seconds,
                         tokens_per_s=tokens / seconds, proposed=proposed, accepted=accepted, tested=tested,
                         acceptance_rate=accepted / proposed, alpha=accepted / tested, k_histogram=histogram,
                         mean_k=0.0, target_forward_passes=passes, mean_accepted_length=tokens / passes,
                         draft_seconds=0.1, verify_seconds=0.2, other_seconds=0.05, outputs=[[1, 2]])

    pooled = pool_runs([run(100, 1.0, 60, 30, 40, {"0": 10, "1": 0, "2": 20}, 30),
                        run(100, 3.0, 40, 10, 30, {"0": 30, "1": 5}, 35)])
    assert pooled.tokens == 200 and pooled.seconds == 4.0 and pooled.tokens_per_s == 50.0  # not mean(100, 33)
    assert pooled.acceptance_rate == pytest.approx(40 / 100) and pooled.alpha == pytest.approx(40 / 70)
    assert pooled.k_histogram == {"0": 40, "1": 5, "2": 20}
    assert pooled.mean_k == pytest.approx((5 + 40) / 65)
    assert pooled.mean_accepted_length == pytest.approx(200 / 65)
    assert pooled.draft_seconds == pytest.approx(0.2) and pooled.outputs == [[1, 2]]
    one = run(10, 1.0, 6, 3, 4, {"0": 1}, 3)
    assert pool_runs([one]) is one


def test_bench_repeats_run_every_system_again_and_pool(tmp_path, capsys):
    from specdec_app.cli import main

    target, draft, prompts = bench_inputs(tmp_path, num_prompts=2)
    out = tmp_path / "out"
    rc = main(["bench", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts), "--quick",
               "--systems", "engine,spec-draft", "--batch-sizes", "1", "--temperatures", "0", "--repeats", "3",
               "--threads", "1", "--cost-steps", "3", "--out", str(out), "--no-progress"])
    assert rc == 0
    data = json.loads((out / "bench.json").read_text())
    assert data["config"]["repeats"] == 3
    assert [r["system"] for r in data["results"]] == ["engine", "spec-draft"]
    for r in data["results"]:
        assert r["tokens"] == 3 * 2 * 16 and "pooled over 3 timed runs" in r["notes"]
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
    assert data["results"][1]["same_output_as_plain"] == 1.0
    assert main(["bench", "--target", str(target), "--prompts", str(prompts), "--repeats", "0", "--no-progress"]) == 2


def test_bench_tree_rows_report_nodes_the_share_of_trees_and_acceptance_by_depth(tmp_path, capsys):
    """The tree systems beside the chains: at fixed K every draft is a tree (2 branches, the other a
    leaf: K + 1 nodes); where the policy chooses, a share of them; the same tokens as plain."""
    from specdec_app.cli import main

    target, draft, prompts = bench_inputs(tmp_path, num_prompts=2)
    out = tmp_path / "out"
    rc = main(["bench", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts), "--quick",
               "--systems", "engine,spec-draft-tree-fixed,spec-draft-tree", "--batch-sizes", "1",
               "--temperatures", "0", "-k", "3", "--tree-branches", "2", "--tree-side-depth", "1",
               "--max-new-tokens", "8", "--threads", "1", "--cost-steps", "2", "--out", str(out), "--no-progress"])
    assert rc == 0
    assert "the share of drafts that were trees" in capsys.readouterr().out
    rows = {r["system"]: r for r in json.loads((out / "bench.json").read_text())["results"]}
    fixed, chosen = rows["spec-draft-tree-fixed"], rows["spec-draft-tree"]
    assert fixed["tree_share"] == 1.0 and 1.0 < fixed["nodes_per_pass"] <= 4.0
    assert (chosen["tree_share"] is None) == (chosen["nodes_per_pass"] is None)  # (None: it never drafted)
    assert fixed["acceptance_by_depth"]
    assert fixed["same_output_as_plain"] == chosen["same_output_as_plain"] == 1.0


def test_bench_oracle_runs_every_fixed_k_beside_the_adaptive_row(tmp_path, capsys):
    from specdec_app.cli import main

    target, draft, prompts = bench_inputs(tmp_path, num_prompts=2)
    out = tmp_path / "out"
    rc = main(["bench", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts), "--quick",
               "--systems", "engine,spec-draft", "--batch-sizes", "1", "--temperatures", "0", "-k", "3",
               "--max-new-tokens", "6", "--threads", "1", "--cost-steps", "2", "--oracle", "--out", str(out),
               "--no-progress"])
    assert rc == 0
    assert "the adaptive policy against the best of plain and every fixed K" in capsys.readouterr().out
    [row] = json.loads((out / "bench.json").read_text())["oracle"]
    assert row["system"] == "spec-draft" and set(row["fixed"]) == {"K=1", "K=2", "K=3"}
    rates = {**row["fixed"], "plain": row["plain"]}
    assert row["best"] == max(rates, key=rates.get) and row["best_tokens_per_s"] == max(rates.values())
    assert row["adaptive_vs_best"] == pytest.approx(row["adaptive"] / row["best_tokens_per_s"])


def test_bench_policy_measures_each_pair_against_its_oracle(tmp_path, capsys):
    from specdec_app.cli import main

    target, draft, prompts = bench_inputs(tmp_path, num_prompts=2)
    out = tmp_path / "policy.json"
    rc = main(["bench-policy", "--only-pairs", "--pair", f"{target}:{draft}", "--pair", f"{target}:ngram",
               "--prompts", str(prompts), "--quick", "-k", "2", "--threads", "1", "--json", str(out),
               "--draft-weights", "fp"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "adaptive/best" in printed and "worst adaptive/best" in printed and "A/A: plain timed twice" in printed
    written = json.loads(out.read_text())
    assert written["draft_weights"] == "fp"
    rows = written["rows"]
    assert [(r["batch"], r["mode"]) for r in rows] == [(1, "greedy")] * 2
    assert len({r["pair"] for r in rows}) == 2  # (two pairs of one target: told apart by their drafts)
    for r in rows:
        assert set(r["fixed"]) == {"1", "2"} and r["best"] in ("plain", "K=1", "K=2")
        assert r["vs_best"] == pytest.approx(r["adaptive"] / r["best_rate"])
        assert r["noise"] == pytest.approx(abs(r["plain_again"] / r["plain"] - 1))  # the A/A control, never best
    assert main(["bench-policy", "--pair", "no-colon"]) == 2
    assert main(["bench-policy", "--repeats", "0"]) == 2
    assert main(["bench-policy", "--draft-weights", "q3"]) == 2
    assert "draft.weights must be one of auto, fp, q8, q4" in capsys.readouterr().err


def test_bench_policy_batch_rows_run_a_batch_s_worth_of_prompts(tmp_path, capsys):
    """A batch-2 row runs 2 requests at once though --num-prompts asks 1 (a batch row of fewer
    requests than its size measures another batch); with too few prompts in the file, the file's."""
    from specdec_app.cli import main

    target, draft, prompts = bench_inputs(tmp_path, num_prompts=2)
    out = tmp_path / "policy.json"
    rc = main(["bench-policy", "--only-pairs", "--pair", f"{target}:{draft}", "--prompts", str(prompts),
               "--num-prompts", "1", "--max-new-tokens", "3", "--batch-sizes", "1,2,3", "--temperatures", "0",
               "--repeats", "1", "-k", "1", "--threads", "1", "--json", str(out), "--draft-weights", "fp"])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["prompts"]) for r in rows] == [(1, 1), (2, 2), (3, 2)]
    assert main(["bench-policy", "--only-pairs", "--pair", f"{target}:{draft}", "--prompts", str(prompts),
                 "--num-prompts", "5"]) == 2
    assert main(["bench-policy", "--batch-sizes", "0"]) == 2
    assert "has 2" in capsys.readouterr().err


def test_bench_policy_times_take_turns_and_a_slow_spell_on_one_run_does_not_count():
    """Each system runs each prompt group in turn with the others, after a different one each time,
    and a group counts its median time: a slow spell of the machine during one run (here 3x) leaves
    the rates as they were; pooled seconds (the sum) would have read it as 0.75x."""
    from types import SimpleNamespace

    from specdec_app.bench.policy_command import time_in_turns

    order, slow = [], {("b", 1, 0)}  # (label, repeat, group) of the run in a slow spell
    seconds = {"a": 1.0, "b": 2.0, "c": 4.0}  # per group of 10 tokens

    def run(label, group):
        repeat = order.count((label, group))
        order.append((label, group))
        return SimpleNamespace(tokens=10, seconds=seconds[label] * (3 if (label, repeat, group) in slow else 1))

    rates, results = time_in_turns(["a", "b", "c"], [0, 1], 3, run)
    assert rates == pytest.approx({"a": 10.0, "b": 5.0, "c": 2.5})
    assert [len(r) for r in results.values()] == [6, 6, 6]
    turns = [[label for label, group in order[i:i + 3]] for i in range(0, len(order), 3)]
    assert turns[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
