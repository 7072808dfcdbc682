"""`specdec bench --overlap-only`: plain, serial and overlapped speculation side by side, with the
target and the draft in their own worker processes, on tiny random checkpoints."""
from __future__ import annotations

import json

from test_bench import bench_inputs


def test_bench_overlap_compares_plain_serial_and_overlapped_with_workers_in_processes(tmp_path, capsys):
    from specdec_app.cli import main

    target, draft, prompts = bench_inputs(tmp_path, num_prompts=2)
    out = tmp_path / "out"
    rc = main(["bench", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts), "--quick",
               "--max-new-tokens", "16", "--batch-sizes", "1", "--overlap-only", "--overlap-repeats", "1",
               "--timeline", "--out", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "pre-drafted kept" in printed and "messages/token" in printed and "Mean round timeline" in printed
    assert "load average (1, 5, 15 min)" in printed
    rows = json.loads((out / "overlap.json").read_text())["overlap"]
    by = {(r["system"], r["mode"]): r for r in rows}
    assert {system for system, _ in by} == {"plain", "serial", "overlapped"}
    for mode in ("greedy", "T=0.8"):
        for system in ("plain", "serial", "overlapped"):
            r = by[(system, mode)]
            assert r["tokens"] == 2 * 16 and r["messages"] > 0 and r["wire_bytes"] > 0, r
        assert by[("serial", mode)]["predraft_tokens"] == 0
    # Lossless either way: greedy speculation, serial or overlapped, is plain decoding's output.
    assert by[("overlapped", "greedy")]["outputs"] == by[("serial", "greedy")]["outputs"] \
        == by[("plain", "greedy")]["outputs"]
