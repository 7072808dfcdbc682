"""scripts/policy_calibration.py: acceptance counted per depth as the policy's model counts it (a
token is tested up to the first rejection; one never proposed is not), and the script runs on
the shipped pair."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from policy_calibration import acceptance_by_depth  # noqa: E402


def test_depths_past_the_first_rejection_or_past_the_proposal_are_not_tested():
    rounds = [(3, 0.0, 3, 3),  # all kept: depths 1-3 tested and accepted
              (3, 0.0, 0, 3),  # the first rejected: depth 1 tested
              (3, 0.0, 1, 2)]  # a lookup proposed 2 of 3, the second rejected: depths 1-2
    pooled, rates, tested = acceptance_by_depth(rounds)
    assert dict(tested) == {1: 3, 2: 2, 3: 1}
    assert rates == {1: pytest.approx(2 / 3), 2: 0.5, 3: 1.0}
    assert pooled == pytest.approx(4 / 6)


def test_the_script_prints_its_table_on_the_shipped_pair():
    run = subprocess.run([sys.executable, str(ROOT / "scripts/policy_calibration.py"), "--count", "2",
                          "--new-tokens", "12"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "drafting rounds; acceptance pooled" in run.stdout and "| K | rounds |" in run.stdout
    assert "prior weight: greedy " in run.stdout and ", sampled 4\n" in run.stdout  # (none sampled: the least)
