"""`specdec loadtest` end to end: 64 concurrent streams x 200 tokens (some cancelled mid-way) against
an embedded server with a tiny random target and draft; no stream lost or duplicated, every KV block
free on both workers afterwards, latency figures present and sane. Plus the checker itself."""
from __future__ import annotations

import argparse
import io
import json
import time
from contextlib import redirect_stderr, redirect_stdout
from types import SimpleNamespace

import pytest

from specdec_app import cli
from specdec_app.loadtest import command as loadtest_command
from specdec_app.loadtest.records import LoadConfig, build_report, make_streams, percentile

from checkpoints import CONFIGS, build_checkpoint, perturbed_copy
from served_pair import save_tokenizer

STREAMS, TOKENS = 64, 200


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = build_checkpoint(tmp_path_factory.mktemp("load-target"), seed=0, max_position_embeddings=256,
                              **CONFIGS["gqa_untied"])
    save_tokenizer(target)
    # Small noise: the draft is accepted often enough that messages carry 1..K+1 tokens.
    draft = perturbed_copy(target, tmp_path_factory.mktemp("load-draft"), noise=0.05)
    return SimpleNamespace(target=str(target), draft=str(draft))


def parse(argv):
    parser = argparse.ArgumentParser()
    loadtest_command.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.timeout(240)
def test_embedded_load_64_streams(models, tmp_path):
    out_json = tmp_path / "report.json"
    args = parse(["--embedded", "--target", models.target, "--draft", models.draft, "-k", "4",
                  "--streams", str(STREAMS), "--max-new-tokens", str(TOKENS), "--cancel-fraction", "0.1",
                  "--temperature", "0.8", "--seed", "3", "--verify-sample", "2", "--timeout", "150",
                  "--json", str(out_json), "--no-progress", "--max-batch-size", str(STREAMS)])
    out = io.StringIO()
    t0 = time.monotonic()
    with redirect_stdout(out):
        rc = loadtest_command.run(args)
    elapsed = time.monotonic() - t0
    report = json.loads(out_json.read_text())
    print(out.getvalue(), f"\n(whole command {elapsed:.1f} s)")
    assert rc == 0, out.getvalue()
    assert report["ok"] and report["failures"] == []
    # No loss, no duplicate: every stream accounted for exactly once.
    n_cancel = round(STREAMS * 0.1)
    assert report["missing"] == 0 and report["failed"] == 0
    assert report["completed"] + report["cancelled"] == STREAMS
    assert 1 <= report["cancelled"] <= n_cancel  # one may finish before its cancel point
    assert report["completed"] * TOKENS <= report["generated_tokens"] < STREAMS * TOKENS
    # Every KV block is free on both workers.
    assert report["kv_blocks_used_target"] == 0 and report["kv_blocks_used_draft"] == 0
    assert report["verified_streams"] == 2
    # Latency figures are present and sane.
    for name in ("ttft", "itl_message", "itl_token"):
        p50, p99 = report[f"{name}_p50_ms"], report[f"{name}_p99_ms"]
        assert p50 is not None and p99 is not None and 0 < p50 <= p99 < 150_000, (name, p50, p99)
    assert report["itl_token_p50_ms"] <= report["itl_message_p50_ms"] + 1e-9  # a message carries >= 1 token
    assert report["throughput_tokens_per_s"] == pytest.approx(report["generated_tokens"] / report["wall_seconds"])
    assert report["throughput_tokens_per_s"] > 0 and report["wall_seconds"] < 150
    text = out.getvalue()
    for label in ("throughput", "time to first token", "inter-token latency per token", "checks"):
        assert label in text
    assert "PASS" in text


def test_cli_registers_loadtest_and_unreachable_server_fails_fast():
    err = io.StringIO()
    t0 = time.monotonic()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        rc = cli.main(["loadtest", "--address", "127.0.0.1:1", "--streams", "2", "--max-new-tokens", "2",
                       "--timeout", "2", "--no-progress"])
    assert rc == 2 and "not reachable" in err.getvalue()
    assert time.monotonic() - t0 < 10
    err = io.StringIO()
    with redirect_stderr(err):
        assert cli.main(["loadtest", "--grpc-workers", "--streams", "1"]) == 2
        assert cli.main(["loadtest", "--embedded", "--kv-block-size", "0", "--streams", "1"]) == 2
    assert "--grpc-workers needs --embedded" in err.getvalue() and "target.kv_block_size" in err.getvalue()


def _record(cfg, **kw):
    rec = make_streams(cfg, "t")[0]
    for k, v in kw.items():
        setattr(rec, k, v)
    return rec


def test_checker_flags_lost_short_duplicated_and_mixed_up_streams():
    cfg = LoadConfig(streams=1, max_new_tokens=5, cancel_fraction=0.0, vocab_size=50)
    good = dict(status="completed", token_ids=[1] * 5, finish_reason="length", finish_messages=1,
                stats_generated=5, ttft=0.01)
    assert build_report(cfg, [_record(cfg, **good)], 1.0).ok
    cases = {
        "never finished": dict(status="pending"),
        "expected exactly 5": dict(good, token_ids=[1] * 4, stats_generated=4),
        "without a finish_reason": dict(good, finish_reason="", finish_messages=0),
        "after the finish": dict(good, messages_after_finish=1),
        "2 finish messages": dict(good, finish_messages=2),
        "the server counted": dict(good, stats_generated=6),
        "streams mixed up": dict(good, stats_prompt_tokens=999),
        "failed: UNAVAILABLE": dict(status="failed", error="UNAVAILABLE: gone"),
    }
    for needle, fields in cases.items():
        report = build_report(cfg, [_record(cfg, **fields)], 1.0)
        assert not report.ok and any(needle in f for f in report.failures), (needle, report.failures)


def test_streams_are_distinct_and_cancel_points_mid_way():
    cfg = LoadConfig(streams=64, max_new_tokens=200, cancel_fraction=0.1, seed=5)
    records = make_streams(cfg, "run")
    assert len({r.prompt for r in records}) == 64 and len({r.tag for r in records}) == 64
    cancels = [r.cancel_after for r in records if r.cancel_after is not None]
    assert len(cancels) == 6 and all(0 <= c < 200 for c in cancels) and 0 in cancels
    ids = make_streams(LoadConfig(streams=300, vocab_size=120), "run")
    assert len({tuple(r.prompt) for r in ids}) == 300
    assert all(0 <= t < 120 for r in ids for t in r.prompt)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([], 50) is None
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
