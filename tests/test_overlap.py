"""Overlapped drafting: the draft pre-drafts round r+1 while the target verifies round r.

Exact (greedy output is the target's, in process and over gRPC workers), reproducible (a seeded
request gives the same tokens with random delays in either worker, and the same as serial
rounds), and safe with requests joining, leaving and being cancelled mid-pipeline, with a draft
lost during a pre-draft, with adaptive K and with the n-gram drafter.
"""
from __future__ import annotations

import random

import pytest

from coordinator.rounds.errors import WorkerUnavailable
from coordinator.rounds.grpc_clients import GrpcDraftClient, GrpcTargetClient
from coordinator.rounds.request import Request
from coordinator.rounds.scheduler import Scheduler
from coordinator.speculation.predraft_gate import PROBE_EVERY, PreDraftGate
from coordinator.telemetry.metrics import RoundMetrics
from coordinator.telemetry.prometheus_metrics import PrometheusMetrics
from draft_worker import grpc_server as draft_server
from draft_worker.worker import DraftWorker
from specdec import LocalEngine, SamplingParams, ServiceConfig
from specdec.config import SchedulerConfig
from target_worker import grpc_server as target_server
from target_worker.worker import TargetWorker

from checkpoints import CONFIGS, SlowWorker, build_checkpoint, perturbed_copy, predraft_always, use_policy

PROMPTS = [[3, 17, 42, 7, 99, 12, 5], [8, 8, 8, 21, 30, 8, 8, 8, 21], [150, 4], list(range(40, 60))]
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = build_checkpoint(tmp_path_factory.mktemp("overlap-target"), seed=0, initializer_range=0.1,
                              **CONFIGS["gqa_untied"])
    # Close to the target: whole rounds are often accepted (pre-drafts kept), and often not.
    draft = perturbed_copy(target, tmp_path_factory.mktemp("overlap-draft"), noise=0.05)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def plain_outputs(models):
    engine = LocalEngine(models[0], draft=None, num_speculative_tokens=0)
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


class Tally:
    """Sums the overlap fields of every RoundReport."""

    def __init__(self):
        self.kept = self.hits = self.misses = self.predrafted = 0

    def __call__(self, report) -> None:
        self.kept += report.predraft_kept
        self.hits += report.predraft_hits
        self.misses += report.predraft_misses
        self.predrafted += report.predraft_tokens


def assert_no_blocks_held(target_worker, draft_worker) -> None:
    target_worker.cache.check_accounting()
    assert target_worker.cache.allocator.num_used == 0
    draft_cache = draft_worker.drafter.kv_cache
    if draft_cache is not None:
        draft_cache.check_accounting()
        assert draft_cache.allocator.num_used == 0


@pytest.mark.parametrize("policy", ["fixed", "jumping", "adaptive"])
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_with_overlap_is_the_target_output_in_process(models, plain_outputs, policy, drafter):
    tally = Tally()
    engine = LocalEngine(models[0], draft=models[1] if drafter == "model" else "ngram", num_speculative_tokens=4,
                         adaptive=False, overlap=True, on_round=tally)
    use_policy(engine, policy)
    predraft_always(engine.scheduler)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == plain_outputs
    if (drafter, policy) != ("ngram", "adaptive"):  # (lookups that find nothing soon stop being asked for)
        assert tally.kept > 0 and tally.hits > 0, "no pre-draft was kept: the overlap path was not exercised"
    assert tally.misses > 0 or drafter == "ngram"  # dropped pre-drafts too (a close, not identical, draft)
    assert_no_blocks_held(engine.target_worker, engine.draft_worker)
    assert not engine.scheduler.predrafting.pending and not engine.scheduler.predrafting.ready


def test_greedy_with_overlap_is_the_target_output_over_grpc_workers(models, plain_outputs):
    config = ServiceConfig.from_settings(target=models[0], draft=models[1], kv_cache_blocks=64)
    target_worker, draft_worker = TargetWorker.from_config(config.target), DraftWorker.from_config(config.draft)
    tserver, tport = target_server.serve(target_worker)
    dserver, dport = draft_server.serve(draft_worker)
    target, draft = GrpcTargetClient(f"127.0.0.1:{tport}"), GrpcDraftClient(f"127.0.0.1:{dport}")
    try:
        sched = predraft_always(Scheduler(target, draft, None,
                                          SchedulerConfig(num_speculative_tokens=4, adaptive=False, overlap=True)))
        for i, prompt in enumerate(PROMPTS):
            sched.add_request(Request(f"g{i}", prompt, GREEDY))
        outputs, tally = {f"g{i}": [] for i in range(len(PROMPTS))}, Tally()
        while sched.has_work():
            report = sched.step()
            tally(report)
            for update in report.updates:
                assert update.error is None, update.error
                outputs[update.req_id] += update.token_ids
        assert [outputs[f"g{i}"] for i in range(len(PROMPTS))] == plain_outputs
        assert tally.kept > 0
        assert_no_blocks_held(target_worker, draft_worker)
    finally:
        target.close(), draft.close()
        tserver.stop(None), dserver.stop(None)


SEEDED = [SamplingParams(max_new_tokens=20, temperature=0.9, seed=7 + i, ignore_eos=True) for i in range(4)]


def test_seeded_requests_are_reproducible_under_random_delays_with_overlap(models):
    """Delays in either worker change when a pre-draft finishes relative to the verify, never what
    it computes (the step waits for both); the result is also the serial rounds' result."""
    def run(overlap: bool, delays: int | None) -> list[list[int]]:
        engine = LocalEngine(models[0], draft=models[1], num_speculative_tokens=4, adaptive=False, overlap=overlap)
        predraft_always(engine.scheduler)
        if delays is not None:
            rng = random.Random(delays)
            engine.scheduler.draft = SlowWorker(engine.scheduler.draft, rng, "propose")
            engine.scheduler.target = SlowWorker(engine.scheduler.target, rng, "verify")
        return [o.token_ids for o in engine.generate(PROMPTS, SEEDED)]

    quiet = run(True, None)
    assert run(True, 1) == quiet
    assert run(True, 2) == quiet
    assert run(False, None) == quiet


def test_requests_joining_leaving_and_cancelled_mid_pipeline_leave_no_state_or_blocks(models, plain_outputs):
    engine = LocalEngine(models[0], draft=models[1], num_speculative_tokens=4, adaptive=False, overlap=True,
                         max_batch_size=8)
    sched = predraft_always(engine.scheduler)
    outputs: dict[str, list[int]] = {}
    cancelled = set()
    rng = random.Random(3)
    joined = 0
    for step in range(400):
        if joined < 12 and step % 2 == 0:  # join while others are mid-pipeline
            sched.add_request(Request(f"j{joined}", PROMPTS[joined % len(PROMPTS)], GREEDY))
            outputs[f"j{joined}"] = []
            joined += 1
        if step in (5, 9, 14):  # cancel one that has a pre-draft pending or confirmed
            held = sorted(set(sched.predrafting.ready) | set(sched.predrafting.pending)) or sorted(sched.running)
            if held:
                victim = rng.choice(held)
                assert sched.abort(victim)
                cancelled.add(victim)
        if not sched.has_work() and joined == 12:
            break
        for update in sched.step().updates:
            assert update.error is None, update.error
            outputs[update.req_id] += update.token_ids
    assert len(cancelled) == 3
    for req_id, tokens in outputs.items():
        if req_id not in cancelled:  # the survivors are unaffected by their batch mates leaving
            assert tokens == plain_outputs[int(req_id[1:]) % len(PROMPTS)]
    assert not sched.running and not sched.predrafting.pending and not sched.predrafting.ready
    assert_no_blocks_held(engine.target_worker, engine.draft_worker)
    assert not engine.draft_worker.drafter._seqs


class PreDraftFails:
    """A draft whose pre-draft calls (tasks with assumed tokens) raise WorkerUnavailable `times` times."""

    def __init__(self, inner, times: int):
        self.inner, self.times, self.failed = inner, times, 0

    def info(self):
        return self.inner.info()

    def propose(self, tasks, finished):
        if self.failed < self.times and any(t.assumed_tokens for t in tasks):
            self.failed += 1
            raise WorkerUnavailable("draft worker unavailable (test): killed during a pre-draft")
        return self.inner.propose(tasks, finished)


def test_draft_lost_during_a_pre_draft_costs_speculation_not_output(models, plain_outputs, monkeypatch):
    monkeypatch.setattr("coordinator.rounds.worker_health.FIRST_BACKOFF_S", 0.0)  # retry the draft at once
    engine = LocalEngine(models[0], draft=models[1], num_speculative_tokens=4, adaptive=False, overlap=True,
                         worker_recovery_timeout=5.0)
    predraft_always(engine.scheduler)
    engine.scheduler.draft = failing = PreDraftFails(engine.scheduler.draft, times=2)
    tally = Tally()
    engine.on_round = tally
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == plain_outputs
    assert failing.failed == 2 and tally.kept > 0  # overlap came back after the draft did
    assert_no_blocks_held(engine.target_worker, engine.draft_worker)


def test_the_gate_stops_pre_drafting_requests_whose_pre_drafts_are_dropped_but_probes_them():
    gate = PreDraftGate()
    assert gate.admits("a", greedy=True, seeded=False)  # the prior gives a new request a chance
    tried = 0
    for _ in range(40):
        if gate.admits("a", greedy=True, seeded=False):
            tried += 1
            gate.observe("a", greedy=True, hit=False)
    assert 3 <= tried <= 40 // PROBE_EVERY + 4  # a few tries, then a probe every PROBE_EVERY rounds
    for _ in range(10):
        gate.observe("b", greedy=True, hit=True)
    assert gate.admits("b", greedy=True, seeded=False)
    # In a batch, pre-drafts spare the draft call only if all are kept: rates of 0.6 in a batch
    # of 4 (0.13 < BATCH_THRESHOLD) pre-draft only the seeded request, by its own rule.
    batch = PreDraftGate()
    for req_id in "wxyz":
        for hit in (True, True, True, False, False):
            batch.observe(req_id, greedy=True, hit=hit)
    assert batch.select([("w", True, False), ("x", True, False), ("y", True, False), ("z", False, True)]) == {"z"}
    assert batch.select([("w", True, False)]) == {"w"}
    # A seeded request's decisions depend on its own verdicts only, not on the others' record.
    fresh = PreDraftGate()
    assert gate.hit_rate("s", greedy=False, seeded=True) == fresh.hit_rate("s", greedy=False, seeded=True)


def test_greedy_with_the_real_gate_is_the_target_output(models, plain_outputs):
    """One request at a time (the gate pre-drafts a batch only when all of it is likely kept)."""
    tally, metrics, prometheus = Tally(), RoundMetrics(export=False), PrometheusMetrics()

    def on_round(report):
        tally(report), metrics(report), prometheus.on_round(report)

    engine = LocalEngine(models[0], draft=models[1], num_speculative_tokens=4, adaptive=False, overlap=True,
                         on_round=on_round, max_batch_size=1)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == plain_outputs
    assert tally.predrafted > 0
    # The metrics see the same: the kept fraction in the snapshot, both counters on /metrics.
    snap = metrics.snapshot()
    assert (snap["predraft_tokens"], snap["predraft_kept"]) == (tally.predrafted, tally.kept)
    assert snap["predraft_kept_fraction"] == tally.kept / tally.predrafted
    text = prometheus.render().decode()
    assert f"specdec_predraft_tokens_total {float(tally.predrafted)}" in text
    assert f"specdec_predraft_kept_total {float(tally.kept)}" in text
    assert_no_blocks_held(engine.target_worker, engine.draft_worker)
