"""scripts/gpu_check.py, the prepared device check, runs its every check on this machine's CPU
(--device cpu --quick) from the checkout, with nothing imported that a bare CUDA machine lacks
(grpc, Ray, fastapi): what a GPU session runs once must not fail for a reason CI could catch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_device_check_runs_on_the_cpu_and_writes_its_reports(tmp_path):
    run = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "scripts/gpu_check.py"), "--device", "cpu",
                          "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = {line.split("|")[-1].strip().split(".")[0] for line in run.stderr.splitlines() if "import time:" in line}
    assert not loaded & {"grpc", "ray", "fastapi", "uvicorn"}
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["speculative_greedy_equals_target_greedy_float32"] is True
    assert report["mixed_sampled_batch_with_overlap_lengths"] == [24, 24, 24]
    assert report["parity_float32_max_abs"] < 1e-3 and report["parity_bfloat16_max_abs"] < 0.05
    assert report["host_syncs_per_round"] > 0 and report["cost_ratio_c"] > 0 and report["step_over_floor"] > 0
    assert report["q8_row_alone_equals_in_8_and_40"] is True and report["q4_row_alone_equals_in_8_and_40"] is True
    assert report["tree_fixed_2x3_greedy_equals_target_greedy_float32"] is True
    assert report["tree_seeded_sampled_batch_reproduces"] is True
    # The echo pair's draft repeats the target's token: at K = 5 nearly all of it is accepted.
    assert report["policy_echo_b1_greedy_greedy_all_equal_plain"] is True
    assert report["policy_echo_b1_greedy_K=5_tokens_per_round"] > 3
    assert "| speculative_greedy_equals_target_greedy_float32 | True |" in (tmp_path / "gpu_check.md").read_text()


def test_the_quantized_sweep_ranks_launches_by_a_targets_step():
    """gpu_kernel_bench's summary, which model.triton_quantized.LAUNCH is chosen from: a layer's
    projections count once a layer, the LM head once; cuBLAS's time (on every row) counts once."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_kernel_bench as bench
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    fast, slow = bench.QUANTIZED_CONFIGS[:2]
    rows = [{"shape": "3B", "product": product, "bits": 8, "config": list(config), "cublas_bf16_us": 1.0, "us": us}
            for product, config, us in [("qkv", fast, 2.0), ("qkv", slow, 1.0), ("lm_head", fast, 10.0),
                                        ("lm_head", slow, 50.0)]]
    summary = bench.step_products_us(rows)
    assert [step["launch"] for step in summary] == ["cublas_bf16", fast, slow]
    assert [step["3B"] for step in summary] == [28 + 1, 28 * 2 + 10, 28 + 50]
