"""No test may depend on how fast the machine is: a few tests that hold the service in the state
they check (tests/gates.py) run again, in pytest subprocesses, under SPECDEC_TEST_PACE=slow (the
service ~3-7x slower) and =fast (the tests look ~10x later); see tests/conftest.py. The files with
concurrent tests pass whole under either pace; CI reruns only this selection, to keep it short.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from gates import PACE

ROOT = Path(__file__).resolve().parents[1]
# One of each kind of gate: a replica held while the autoscaler looks (under "fast" its clock runs
# slower, which made the ungated test fail), a request held until its cancel / deadline / drain
# has been seen, and a stream held while its worker dies during a drain.
SELECTION = [
    "tests/test_pace.py::test_the_pace_is_in_effect",
    "tests/test_replicas.py::test_in_process_autoscaling_adds_a_replica_under_load_and_drains_it_when_idle",
    "tests/test_server_e2e.py::test_client_cancel_frees_kv_blocks",
    "tests/test_server_e2e.py::test_deadline_exceeded_frees_kv_blocks",
    "tests/test_server_e2e.py::test_graceful_stop_and_auth",
    "tests/test_resume.py::test_a_worker_killed_while_the_server_drains_its_streams_still_finish[serial]",
]


def test_the_pace_is_in_effect():
    """What SPECDEC_TEST_PACE installs (conftest's session fixture), checked where it runs."""
    import coordinator.replicas.router
    from draft_worker.ngram_drafter import NgramDrafter
    from specdec.client import GenerationClient
    from specdec.model.runner import ModelRunner

    slowed = ModelRunner.run.__name__ == NgramDrafter.propose.__name__ == "slowed"
    late = coordinator.replicas.router.time is not time and GenerationClient.generate_stream.__name__ == "<lambda>"
    assert (slowed, late) == (PACE == "slow", PACE == "fast")


def test_gated_tests_pass_under_a_slow_and_a_fast_pace():
    # Both paces at once: their tests mostly wait (on gates, on the paces' sleeps).
    runs = {}
    for pace in ("slow", "fast"):
        env = {**os.environ, "SPECDEC_TEST_PACE": pace}
        runs[pace] = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x",
                                       "-o", "timeout=150", *SELECTION], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outputs = {pace: run.communicate(timeout=300)[0] for pace, run in runs.items()}
    for pace, run in runs.items():
        assert run.returncode == 0, f"SPECDEC_TEST_PACE={pace}:\n{outputs[pace][-6000:]}"
        assert f"{len(SELECTION)} passed" in outputs[pace], outputs[pace][-2000:]
