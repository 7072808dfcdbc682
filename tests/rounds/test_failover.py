"""Failures (coordinator.rounds.failover): a worker that breaks a round ends its requests and
frees everything, a drafter that lies fails only its own request, ids reused right after."""
from __future__ import annotations

import time

import pytest
import torch

from coordinator.rounds.request import Request
from coordinator.rounds.scheduler import Scheduler
from draft_worker.worker import DraftWorker
from specdec import SamplingParams
from specdec.config import NGRAM, DraftConfig, SchedulerConfig, WorkerConfig
from specdec.model.decoder import load_model
from specdec.model.runner import ModelRunner
from target_worker.worker import TargetWorker

from round_helpers import (
    DRAFTS,
    PROMPTS,
    _assert_caches_empty,
    _engine,
)

# ---------------------------------------------------------------- worker failures

class FlakyTarget:
    def __init__(self, inner, fail_on_call: int):
        self.inner, self.fail_on_call, self.calls = inner, fail_on_call, 0

    def info(self):
        return self.inner.info()

    def verify(self, tasks, finished):
        self.calls += 1
        if self.calls == self.fail_on_call:
            self.inner.verify(tasks, finished)  # the worker did the work, then the reply was lost
            raise RuntimeError("injected failure")
        return self.inner.verify(tasks, finished)


def test_worker_failure_ends_the_round_and_frees_everything(target_dir, reference):
    model = load_model(str(target_dir))
    target = TargetWorker(ModelRunner(model, WorkerConfig(kv_cache_blocks=64, kv_block_size=4)))
    draft = DraftWorker.from_config(DraftConfig(model=NGRAM))
    flaky = FlakyTarget(target, fail_on_call=3)
    sched = Scheduler(flaky, draft, None, SchedulerConfig(num_speculative_tokens=3, adaptive=False))
    sched.add_request(Request("a", PROMPTS[0], SamplingParams(max_new_tokens=10)))
    sched.add_request(Request("b", PROMPTS[3], SamplingParams(max_new_tokens=10)))
    reasons = {}
    while sched.has_work():
        for u in sched.step().updates:
            if u.finished:
                reasons[u.req_id] = u.finish_reason
                if u.finish_reason == "error":
                    assert "injected failure" in u.error and u.error_kind == "internal"
    assert reasons == {"a": "error", "b": "error"}
    target.cache.check_accounting()
    assert target.cache.allocator.num_used == 0 and target._seqs == {}
    assert draft.drafter._tokens == {}
    # the scheduler keeps serving
    sched.add_request(Request("c", PROMPTS[1], SamplingParams(max_new_tokens=8)))
    got = []
    while sched.has_work():
        for u in sched.step().updates:
            got.extend(u.token_ids)
    assert got == reference(PROMPTS[1], 8)
    assert target.cache.allocator.num_used == 0


def test_scheduler_config_rejects_a_negative_default(target_dir):
    with pytest.raises(ValueError, match="scheduler.num_speculative_tokens"):
        SchedulerConfig(num_speculative_tokens=-1)


@pytest.mark.parametrize("draft", DRAFTS)
def test_request_id_can_be_reused_right_after_it_ends(target_dir, reference, draft):
    """The release of the old request and the admission of the new one land in the same round:
    the workers must release first, then start the new sequence from scratch."""
    engine = _engine(target_dir, draft, num_speculative_tokens=3)
    sched = engine.scheduler

    def run_to_end(rid):
        got = []
        while sched.has_work():
            for u in sched.step().updates:
                if u.req_id == rid:
                    got.extend(u.token_ids)
        return got

    sched.add_request(Request("x", PROMPTS[0], SamplingParams(max_new_tokens=20)))
    sched.step()
    sched.step()
    assert sched.abort("x")
    sched.add_request(Request("x", PROMPTS[1], SamplingParams(max_new_tokens=9)))
    assert run_to_end("x") == reference(PROMPTS[1], 9)
    # finished normally, then reused before any flush step
    sched.add_request(Request("y", PROMPTS[2], SamplingParams(max_new_tokens=2)))
    while "y" in sched.running or sched.waiting:
        sched.step()
    sched.add_request(Request("y", PROMPTS[3], SamplingParams(max_new_tokens=11)))
    assert run_to_end("y") == reference(PROMPTS[3], 11)
    _assert_caches_empty(engine)


class LyingDrafter:
    """Wraps a draft worker; for request "evil" it claims q = 0 on the tokens it proposes, which
    an unsuspecting verifier would accept whenever the target gives them any probability."""

    def __init__(self, inner):
        self.inner = inner

    def info(self):
        return self.inner.info()

    def propose(self, tasks, finished):
        proposals = self.inner.propose(tasks, finished)
        for p in proposals:
            if p.req_id == "evil" and p.tokens:
                p.q.probs[:] = torch.where(p.q.token_ids == torch.tensor(p.tokens)[:, None], 0.0, p.q.probs)
                p.q.probs[:] /= p.q.probs.sum(dim=1, keepdim=True).clamp_min(1e-9)
        return proposals


def test_a_drafter_that_lies_about_q_fails_only_its_own_request(target_dir):
    engine = _engine(target_dir, "self", num_speculative_tokens=3)
    sched = engine.scheduler
    sched.draft = LyingDrafter(sched.draft)
    sampled = SamplingParams(max_new_tokens=12, temperature=0.9, seed=4)
    sched.add_request(Request("evil", PROMPTS[0], sampled))
    sched.add_request(Request("fair", PROMPTS[1], sampled))
    updates = {}
    while sched.has_work():
        for u in sched.step().updates:
            updates.setdefault(u.req_id, []).append(u)
    evil, fair = updates["evil"][-1], updates["fair"][-1]
    assert evil.finish_reason == "error" and evil.error_kind == "internal"
    assert "refused" in evil.error and "probability 0 under the q" in evil.error
    assert fair.finish_reason == "length"
    alone = _engine(target_dir, "self", num_speculative_tokens=3).generate([PROMPTS[1]], sampled)[0]
    assert sum((u.token_ids for u in updates["fair"]), []) == alone.token_ids
    _assert_caches_empty(engine)




# ---------------------------------------------------------------- Failover on its own

def _run(req_id: str, started: bool = True, k: int = 3, seeded: bool = False):
    from coordinator.rounds.request import RunningRequest
    from coordinator.rounds.text_stream import TextStream

    params = SamplingParams(temperature=0.8, seed=1) if seeded else SamplingParams()
    run = RunningRequest(request=Request(req_id, [1, 2], params, client_seed=seeded), num_speculative_tokens=k,
                         stream=TextStream(None, ()), generated=[3])
    run.started_target = started
    return run


class _Down:
    """A worker that refuses every call."""

    def verify(self, tasks, finished):
        raise RuntimeError("down")

    def propose(self, tasks, finished):
        raise RuntimeError("down")


def test_failover_keeps_the_releases_a_worker_missed_and_waits_before_trying_again():
    from coordinator.rounds.failover import RELEASE_RETRY_S, Failover

    failover = Failover(SchedulerConfig())
    failover.retired("a", _run("a"))
    failover.retired("b", _run("b", started=False, k=0))  # neither worker holds it
    assert failover.release_target == ["a"] and failover.release_draft == ["a"]
    assert failover.flush(_Down(), _Down()) is None
    assert failover.release_target == ["a"] and failover.release_draft == ["a"]  # kept
    now = time.monotonic()
    assert not failover.releases_due(now) and failover.releases_due(now + RELEASE_RETRY_S + 0.01)


def test_a_lost_target_readmits_its_requests_and_a_lost_draft_resends_their_whole_context():
    from coordinator.rounds.errors import WorkerUnavailable
    from coordinator.rounds.failover import Failover

    failover, running = Failover(SchedulerConfig()), {"a": _run("a"), "s": _run("s", seeded=True)}
    failover.target_lost(WorkerUnavailable("gone"), running)
    assert not running["a"].started_target and failover.release_target == ["a", "s"]
    assert not failover.target_health.up
    failover.draft_lost(WorkerUnavailable("gone"), running)
    assert running["a"].unsent_to_draft == [1, 2, 3] and failover.release_draft == ["a", "s"]
    # Seeded sampled requests wait for their draft (their draws depend on K); the others go on at K = 0.
    assert failover.paused(running["s"], seeded=True) and not failover.paused(running["a"], seeded=False)
