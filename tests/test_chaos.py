"""`specdec loadtest --chaos`: workers SIGKILLed every few seconds under load; every stream still
completes, with exactly the tokens of an uninterrupted run."""
from __future__ import annotations

import argparse
import io
import json
from contextlib import redirect_stdout

import pytest

pytest.importorskip("ray")

from specdec_app.loadtest import command as loadtest_command  # noqa: E402

from checkpoints import CONFIGS, build_checkpoint, perturbed_copy  # noqa: E402


@pytest.mark.timeout(300)
def test_chaos_run_loses_and_changes_nothing(tmp_path):
    target = build_checkpoint(tmp_path / "target", seed=0, max_position_embeddings=256, **CONFIGS["gqa_untied"])
    draft = perturbed_copy(target, tmp_path / "draft", noise=0.1)
    parser = argparse.ArgumentParser()
    loadtest_command.add_arguments(parser)
    out_json = tmp_path / "chaos.json"
    args = parser.parse_args(["--chaos", "3", "--duration", "10", "--streams", "4", "--max-new-tokens", "40",
                              "--cancel-fraction", "0.1", "--vocab-size", "300", "--target", str(target),
                              "--draft", str(draft), "--fixed-k", "--no-progress", "--json", str(out_json)])
    out = io.StringIO()
    with redirect_stdout(out):
        rc = loadtest_command.run(args)
    print(out.getvalue())
    report = json.loads(out_json.read_text())
    assert rc == 0 and report["ok"], report["failures"]
    assert report["failed"] == 0 and report["missing"] == 0 and report["completed"] >= 4
    chaos = report["chaos"]
    # A restart takes seconds here (a new Ray worker loads its model): the next kill waits for it,
    # so a short run may see only one.
    assert len(chaos["kills"]) >= 1 and sum(chaos["resumed"].values()) >= 1
    assert chaos["verified"] == report["completed"] and chaos["different"] == []
    assert "streams with different output             0" in out.getvalue()
