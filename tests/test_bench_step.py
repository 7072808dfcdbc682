"""`specdec bench-step --quick` end to end on the tiny shape: every measurement is printed and
written, and the planted copy answer makes the checkpoint rewrite the paragraph."""
from __future__ import annotations

import json

from specdec_app.cli import main


def test_bench_step_quick_prints_floor_ratio_hf_and_ngram(tmp_path, capsys):
    out_json = tmp_path / "step.json"
    assert main(["bench-step", "--quick", "--threads", "1", "--cache-dir", str(tmp_path / "cache"),
                 "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    for field in ("floor:", "MB of weights per decode step", "GB/s", "x floor", "batch 1: specdec",
                  "batch 8: specdec", "HF", "n-gram drafter", "x plain", "load average"):
        assert field in printed, field
    result = json.loads(out_json.read_text())
    if result["cpu_kernels"]:  # where a C compiler is found: the torch-ops step beside the C kernels'
        assert "through torch's ops instead of the C kernels" in printed
        assert result["torch_ops_step_1"]["step_ms"] > 0
    assert result["weight_bytes"] > 0 and result["matvec_bandwidth_bytes_per_s"] > 0
    for batch in ("1", "8"):
        assert result["step"][batch]["step_ms"] > 0 and result["step"][batch]["over_floor"] > 0
        assert result["generate"][batch]["specdec_ms_per_token"] > 0
        assert result["generate"][batch]["hf_ms_per_token"] > 0
    copy = result["ngram_copy"]
    # Greedy speculation is exact, and the planted bigram table makes the answer the paragraph.
    assert copy["same_output"] and copy["output_is_rewritten_paragraph"]
    assert copy["acceptance_rate"] > 0


def test_bench_step_without_cpu_kernels_says_so(tmp_path, capsys):
    assert main(["bench-step", "--quick", "--no-cpu-kernels", "--threads", "1", "--cache-dir",
                 str(tmp_path / "cache"), "--json", str(tmp_path / "step.json")]) == 0
    assert "C kernels: off (--no-cpu-kernels)" in capsys.readouterr().out
    result = json.loads((tmp_path / "step.json").read_text())
    assert result["cpu_kernels"] is False and result["torch_ops_step_1"] is None


def test_bench_step_reuses_the_cached_checkpoint(tmp_path):
    from specdec_app.bench.shapes import build_copy_checkpoint

    first = build_copy_checkpoint("tiny", tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert build_copy_checkpoint("tiny", tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
