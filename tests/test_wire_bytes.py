"""Bytes on the wire per round, with real draft and target workers over loopback gRPC.

A 4096-token vocabulary makes a dense q expensive (4 bytes x 4096 x K per sequence), so these
checks catch a q that travels when it should not, or wider than the draft sampled from:

- greedy rounds carry no q at all: a few bytes per sequence per draft token;
- sampled rounds carry q sparsified to the draft's max_q_entries (256), far below a dense q;
- top_k=5 requests carry at most 5 entries per position;
- every serial scheduler round is exactly one draft and one target Rounds message (two RPC round
  trips); an overlapped round adds at most one pre-draft message, and a kept pre-draft saves one.

Also the load test's --grpc-workers report and the metrics callback's wire-byte totals.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
from contextlib import redirect_stdout
from types import SimpleNamespace

import pytest

from coordinator.rounds.grpc_clients import GrpcDraftClient, GrpcTargetClient
from coordinator.rounds.request import Request
from coordinator.rounds.scheduler import Scheduler
from coordinator.telemetry.metrics import RoundMetrics
from draft_worker import grpc_server as draft_server
from draft_worker.worker import DraftWorker
from specdec import ServiceConfig
from specdec.config import SchedulerConfig
from specdec.params import SamplingParams
from specdec.v1 import worker_pb2
from specdec_app.loadtest import command as loadtest_command
from target_worker import grpc_server as target_server
from target_worker.worker import TargetWorker

from checkpoints import build_checkpoint, perturbed_copy, predraft_always

VOCAB, K, MAX_Q = 4096, 4, 256
SEQS, TOKENS = 4, 24
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
PROMPTS = [[(7 * i + j * 13) % VOCAB for j in range(6 + i)] for i in range(SEQS)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = build_checkpoint(tmp_path_factory.mktemp("wire-target"), seed=0, max_position_embeddings=128, **TINY)
    draft = perturbed_copy(target, tmp_path_factory.mktemp("wire-draft"), noise=0.05)
    return SimpleNamespace(target=str(target), draft=str(draft))


class Recording:
    """Keeps every Rounds message (request, reply) of a client, as bytes."""

    def __init__(self, client):
        self.messages: list[tuple[bytes, bytes]] = []
        exchange = client._exchange

        def recorded(request, *args, **kwargs):
            reply = exchange(request, *args, **kwargs)
            self.messages.append((request, reply))
            return reply

        client._exchange = recorded


@pytest.fixture(scope="module")
def workers(models):
    config = ServiceConfig.from_settings(target=models.target, draft=models.draft, kv_cache_blocks=64)
    target_worker, draft_worker = TargetWorker.from_config(config.target), DraftWorker.from_config(config.draft)
    assert draft_worker.drafter.max_q_entries == MAX_Q
    tserver, tport = target_server.serve(target_worker)
    dserver, dport = draft_server.serve(draft_worker)
    yield f"127.0.0.1:{dport}", f"127.0.0.1:{tport}"
    tserver.stop(None)
    dserver.stop(None)


def run_rounds(workers, params: SamplingParams | list[SamplingParams], overlap: bool = False) -> dict:
    """Run SEQS requests to the end (`params`: one for all, or one per request); per round: bytes
    and RPCs of each client; every q on the wire (draft replies and verify requests, by req_id)."""
    if not isinstance(params, list):
        params = [params] * SEQS
    draft = GrpcDraftClient(workers[0])
    target = GrpcTargetClient(workers[1])
    draft_log, target_log = Recording(draft), Recording(target)
    try:
        sched = Scheduler(target, draft, None,
                          SchedulerConfig(num_speculative_tokens=K, max_batch_size=SEQS, adaptive=False,
                                          overlap=overlap))
        predraft_always(sched)  # every round pre-drafts: the most messages overlap sends
        for i, prompt in enumerate(PROMPTS):
            sched.add_request(Request(f"r{i}", prompt, dataclasses.replace(params[i], seed=i)))
        metrics = RoundMetrics(wire={"draft": draft.wire, "target": target.wire}, export=False)
        rounds = []
        dw, tw = draft.wire, target.wire
        while sched.has_work():
            before = (dw.rounds, tw.rounds, dw.bytes_sent + dw.bytes_received, tw.bytes_sent + tw.bytes_received)
            report = sched.step()
            metrics(report)
            if not report.ran:
                continue  # nothing ran (releases only)
            rounds.append(dict(
                draft_rpcs=dw.rounds - before[0], target_rpcs=tw.rounds - before[1],
                draft_bytes=dw.bytes_sent + dw.bytes_received - before[2],
                target_bytes=tw.bytes_sent + tw.bytes_received - before[3],
                seqs=report.batch_size, tokens=report.committed_tokens,
                drafting=any(u.num_speculative_tokens for u in report.updates),
                calls=report.worker_calls, predraft_kept=report.predraft_kept))
        draft_q = [(p.req_id, p.q) for _, reply in draft_log.messages
                   for p in worker_pb2.DraftRoundReply.FromString(reply).proposals if p.HasField("q")]
        verify_q = [(t.req_id, t.q) for request, _ in target_log.messages
                    for t in worker_pb2.VerifyRoundRequest.FromString(request).tasks if t.HasField("q")]
        return dict(rounds=rounds, draft_q=[q for _, q in draft_q], verify_q=[q for _, q in verify_q],
                    q_req_ids={r for r, _ in draft_q + verify_q}, metrics=metrics.snapshot(),
                    draft_total=dw.bytes_sent + dw.bytes_received, target_total=tw.bytes_sent + tw.bytes_received)
    finally:
        draft.close()
        target.close()


def report(name: str, res: dict) -> None:
    rounds = res["rounds"]
    per_round = [r["draft_bytes"] + r["target_bytes"] for r in rounds]
    entries = [max(q.row_lengths, default=0) for q in res["draft_q"]]
    print(f"\n[{name}] {len(rounds)} rounds, {sum(r['tokens'] for r in rounds)} tokens; bytes per round "
          f"mean {sum(per_round) / len(per_round):.0f} max {max(per_round)} (draft mean "
          f"{sum(r['draft_bytes'] for r in rounds) / len(rounds):.0f}, target mean "
          f"{sum(r['target_bytes'] for r in rounds) / len(rounds):.0f}); q messages {len(entries)}, "
          f"max entries per position {max(entries, default=0)}; a dense q would be {4 * VOCAB * K} B per "
          f"sequence per round")


def assert_two_rpcs_per_round(res: dict) -> None:
    assert res["rounds"], "no round ran"
    for r in res["rounds"]:
        # One target call per round; one draft call when anyone drafts (near max_new_tokens
        # every K is 0, and the round skips the draft worker unless releases are due).
        assert r["target_rpcs"] == 1 and r["draft_rpcs"] <= 1, r
        assert r["draft_rpcs"] == 1 or not r["drafting"], r


def steady(res: dict) -> list[dict]:
    """Rounds after the first (which carries the prompts)."""
    return res["rounds"][1:]


@pytest.mark.timeout(120)
def test_greedy_rounds_carry_no_q(workers):
    res = run_rounds(workers, SamplingParams(max_new_tokens=TOKENS, ignore_eos=True))
    report("greedy", res)
    assert_two_rpcs_per_round(res)
    assert res["draft_q"] == [] and res["verify_q"] == []
    for r in steady(res):
        assert (r["draft_bytes"] + r["target_bytes"]) / (r["seqs"] * K) < 100, r
    # The metrics callback sees the same bytes.
    wire = res["metrics"]["wire_bytes"]
    assert wire["draft"]["sent"] + wire["draft"]["received"] == res["draft_total"]
    assert wire["target"]["sent"] + wire["target"]["received"] == res["target_total"]


@pytest.mark.timeout(120)
def test_sampled_rounds_send_q_bounded_by_max_q_entries(workers):
    res = run_rounds(workers, SamplingParams(max_new_tokens=TOKENS, ignore_eos=True, temperature=0.8))
    report("sampled T=0.8", res)
    assert_two_rpcs_per_round(res)
    assert res["draft_q"] and len(res["verify_q"]) == len(res["draft_q"])
    for q in res["draft_q"] + res["verify_q"]:
        assert len(q.row_lengths) <= K and all(0 < n <= MAX_Q for n in q.row_lengths)
        assert len(q.token_ids) == len(q.probs) == 4 * sum(q.row_lengths)
    dense = 4 * VOCAB * K
    overhead = 200  # req ids, tokens, params, field tags
    for r in steady(res):
        per_seq = r["draft_bytes"] / r["seqs"]  # the draft's q comes back once...
        assert per_seq <= 8 * MAX_Q * K + overhead, r
        assert (r["draft_bytes"] + r["target_bytes"]) / r["seqs"] <= 2 * (8 * MAX_Q * K) + overhead, r
        assert per_seq < dense / 3, r  # ...and goes on to the target once: far below a dense q


@pytest.mark.timeout(120)
def test_top_k_requests_send_at_most_k_entries(workers):
    res = run_rounds(workers, SamplingParams(max_new_tokens=TOKENS, ignore_eos=True, temperature=0.8, top_k=5))
    report("sampled T=0.8 top_k=5", res)
    assert_two_rpcs_per_round(res)
    assert res["draft_q"]
    for q in res["draft_q"] + res["verify_q"]:
        assert all(0 < n <= 5 for n in q.row_lengths), list(q.row_lengths)
    for r in steady(res):
        assert (r["draft_bytes"] + r["target_bytes"]) / (r["seqs"] * K) < 2 * 8 * 5 + 100, r


@pytest.mark.timeout(180)
def test_loadtest_grpc_workers_reports_wire_bytes(models, tmp_path):
    parser = argparse.ArgumentParser()
    loadtest_command.add_arguments(parser)
    out_json = tmp_path / "wire.json"
    args = parser.parse_args(["--embedded", "--grpc-workers", "--target", models.target, "--draft", models.draft,
                              "-k", str(K), "--streams", "6", "--max-new-tokens", "16", "--cancel-fraction", "0",
                              "--temperature", "0.8", "--timeout", "120", "--json", str(out_json),
                              "--no-progress", "--max-batch-size", "8", "--fixed-k"])
    out = io.StringIO()
    with redirect_stdout(out):
        rc = loadtest_command.run(args)
    print(out.getvalue())
    assert rc == 0, out.getvalue()
    assert "wire bytes per round" in out.getvalue() and "wire bytes per generated token" in out.getvalue()
    wire = json.loads(out_json.read_text())["wire"]
    assert wire["rounds"] > 0 and wire["generated_tokens"] == 6 * 16
    # Overlapped drafting (on by default) adds a pre-draft message beside some verify calls.
    assert wire["rpcs_per_worker"]["draft"] <= 2 * wire["rpcs_per_worker"]["target"]
    assert wire["rpcs_per_worker"]["target"] >= wire["rounds"]
    assert wire["bytes_per_round"]["p99"] >= wire["bytes_per_round"]["mean"] > 0
    assert wire["draft_per_round"]["mean"] > 0 and wire["target_per_round"]["mean"] > 0
    # At least one token per sequence per round; q goes draft -> coordinator -> target.
    assert 0 < wire["bytes_per_token"] <= 2 * 8 * MAX_Q * K + 500 < 2 * 4 * VOCAB * K / 3


@pytest.mark.timeout(120)
def test_mixed_batch_sends_q_only_for_sampled_requests(workers):
    greedy = SamplingParams(max_new_tokens=TOKENS, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=TOKENS, ignore_eos=True, temperature=0.8)
    res = run_rounds(workers, [greedy, sampled, greedy, sampled])
    report("mixed greedy/sampled", res)
    assert_two_rpcs_per_round(res)
    assert res["q_req_ids"] == {"r1", "r3"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_overlapped_rounds_send_at_most_one_pre_draft_beside_each_verify(workers, temperature):
    """Serial vs overlapped on the same requests: one target message per round either way; the
    draft gets at most two (a serial draft after a miss, and the pre-draft), and a round whose
    pre-draft was kept needs no serial one. Messages and bytes per committed token, side by side."""
    params = SamplingParams(max_new_tokens=TOKENS, ignore_eos=True, temperature=temperature)
    serial, overlapped = run_rounds(workers, params), run_rounds(workers, params, overlap=True)
    for name, res in [("serial", serial), ("overlapped", overlapped)]:
        tokens = sum(r["tokens"] for r in res["rounds"])
        messages = sum(r["draft_rpcs"] + r["target_rpcs"] for r in res["rounds"])
        print(f"[T={temperature} {name}] messages per committed token {messages / tokens:.3f}, bytes per "
              f"committed token {(res['draft_total'] + res['target_total']) / tokens:.1f}")
        assert all(r["calls"] == r["draft_rpcs"] + r["target_rpcs"] for r in res["rounds"]), res["rounds"]
    for r in overlapped["rounds"]:
        assert r["target_rpcs"] == 1 and r["draft_rpcs"] <= 2, r
    if temperature == 0:  # (sampled, this pair rarely accepts a whole round: pre-drafts are dropped)
        assert any(r["predraft_kept"] for r in overlapped["rounds"]), "no pre-draft was ever kept"
