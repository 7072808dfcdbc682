"""A lost worker costs its requests a pause, not their output.

Real workers serve over gRPC on fixed loopback ports; a test kills one (its server stops and its
state is gone, as when the process dies) and starts a fresh one on the same port (as Ray restarts
it). The coordinator's scheduler holds every committed token and resumes each request; the
outputs must equal an uninterrupted run, greedy and seeded sampled alike (the workers:
tests/resume_cluster.py). The last tests go through the public server (health, drain). No Ray
here: these run in seconds; tests/test_fault_tolerance.py kills real Ray actors.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2

from coordinator.frontend.server_thread import LOOPBACK_SERVER, run_server_in_thread
from coordinator.rounds.errors import WorkerGone
from coordinator.rounds.grpc_clients import GrpcTargetClient
from coordinator.rounds.request import Request
from coordinator.rounds.scheduler import Scheduler
from specdec import LocalEngine, ServiceConfig
from specdec.client import GenerationClient
from specdec.params import SamplingParams
from target_worker import grpc_server as target_server
from target_worker.worker import TargetWorker

from checkpoints import cheap_drafting_policy
from gates import RoundGate, wait_until
from resume_cluster import GREEDY, PARAMS, PROMPTS, ServedWorker, resume_models, served_cluster
from served_pair import health_status


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return resume_models(tmp_path_factory)


@pytest.fixture(params=[False, True], ids=["serial", "overlap"])
def cluster(models, request):
    yield from served_cluster(models, request.param)


def reference(models, adaptive: bool) -> list[list[int]]:
    engine = LocalEngine(models[0], draft=models[1], num_speculative_tokens=4, adaptive=False)
    if adaptive:
        engine.scheduler.policy = cheap_drafting_policy()
    return [out.token_ids for out in engine.generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def uninterrupted(models):
    return reference(models, adaptive=False)


def run(sched: Scheduler, steps_before: int, action, steps_between: int = 0, after=None,
        tokens_while_down: dict | None = None) -> dict[str, list[int]]:
    """Add the requests, step `steps_before` rounds, do `action`, step `steps_between` more
    (recording tokens committed meanwhile), do `after`, then step to the end."""
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        sched.add_request(Request(f"r{i}", prompt, params))
    out = {f"r{i}": [] for i in range(len(PROMPTS))}
    reasons = {}

    def step():
        for u in sched.step().updates:
            out[u.req_id] += u.token_ids
            if tokens_while_down is not None and action_done[0] and not after_done[0]:
                tokens_while_down[u.req_id] = tokens_while_down.get(u.req_id, 0) + len(u.token_ids)
            if u.finished:
                reasons[u.req_id] = (u.finish_reason, u.error)

    action_done, after_done = [False], [False]
    for _ in range(steps_before):
        step()
    action()
    action_done[0] = True
    for _ in range(steps_between):
        step()
        time.sleep(0.02)
    if after is not None:
        after()
    after_done[0] = True
    deadline = time.monotonic() + 60
    while sched.has_work() or sched.running:
        assert time.monotonic() < deadline, "the requests never finished"
        step()
        time.sleep(0.005)
    assert all(reason == "length" for reason, _ in reasons.values()), reasons
    return out


def assert_caches_free(cluster) -> None:
    cluster.scheduler.step()  # deliver the last releases
    for worker in (cluster.target.worker, cluster.draft.worker):
        cache = worker.cache if isinstance(worker, TargetWorker) else worker.drafter.kv_cache
        cache.check_accounting()
        assert cache.allocator.num_used == 0


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_target_killed_mid_stream_resumes_with_identical_output(cluster, models, uninterrupted, policy):
    if policy == "adaptive":  # the real policy: its state lives in the coordinator and survives
        cluster.scheduler.policy = cheap_drafting_policy()
        uninterrupted = reference(models, adaptive=True)
    out = run(cluster.scheduler, 3, cluster.target.kill, steps_between=5, after=cluster.target.start)
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == uninterrupted
    assert cluster.scheduler.target_health.outages == 1 and cluster.scheduler.target_health.up
    assert_caches_free(cluster)


def test_killed_before_the_first_round_answered(cluster, uninterrupted):
    out = run(cluster.scheduler, 0, cluster.target.kill, steps_between=3, after=cluster.target.start)
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == uninterrupted


class RecordingDraft:
    """Keeps every draft task sent, to see what a restarted draft worker is told."""

    def __init__(self, inner):
        self.inner, self.rounds = inner, []

    def info(self):
        return self.inner.info()

    def propose(self, tasks, finished):
        self.rounds.append((list(tasks), list(finished)))
        return self.inner.propose(tasks, finished)


def test_draft_killed_greedy_goes_on_without_it_seeded_sampled_waits(cluster, uninterrupted):
    while_down: dict = {}
    recorder = cluster.scheduler.draft = RecordingDraft(cluster.scheduler.draft)
    restarted_at = []
    out = run(cluster.scheduler, 3, cluster.draft.kill, steps_between=6,
              after=lambda: (cluster.draft.start(), restarted_at.append(len(recorder.rounds))),
              tokens_while_down=while_down)
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == uninterrupted
    # The restarted draft is told to forget each request and given its whole context back.
    tasks, finished = next(r for r in recorder.rounds[restarted_at[0]:] if r[0])
    assert set(finished) >= {t.req_id for t in tasks}
    for task in tasks:
        i = int(task.req_id[1:])
        context = PROMPTS[i] + out[task.req_id]
        assert task.new_tokens == context[:len(task.new_tokens)] and len(task.new_tokens) > len(PROMPTS[i])
    assert while_down.get("r0", 0) > 0 and while_down.get("r3", 0) > 0  # greedy: kept decoding
    assert while_down.get("r1", 0) == 0 and while_down.get("r2", 0) == 0  # seeded sampled: paused
    assert cluster.scheduler.draft_health.outages == 1
    assert_caches_free(cluster)


def test_a_request_cancelled_while_its_worker_is_down_is_gone_everywhere(cluster, uninterrupted):
    sched = cluster.scheduler

    def kill_and_cancel():
        cluster.target.kill()
        sched.abort("r1")

    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        sched.add_request(Request(f"r{i}", prompt, params))
    for _ in range(3):
        sched.step()
    kill_and_cancel()
    for _ in range(3):
        sched.step()
    cluster.target.start()
    finished = {}
    while sched.running or sched.has_work():
        for u in sched.step().updates:
            if u.finished:
                finished[u.req_id] = u.finish_reason
    assert "r1" not in finished and set(finished) == {"r0", "r2", "r3"}
    assert "r1" not in cluster.target.worker._seqs
    assert_caches_free(cluster)


def test_a_target_gone_for_good_fails_its_requests_clearly_then_serves_when_back(models):
    config = ServiceConfig.from_settings(target=models[0], draft=None, kv_cache_blocks=64, kv_block_size=8,
                                         worker_round_timeout=2.0, worker_recovery_timeout=0.5)
    target = ServedWorker(lambda: TargetWorker.from_config(config.target), target_server.serve)
    client = GrpcTargetClient(target.address, 2.0)
    try:
        sched = Scheduler(client, None, None, config.scheduler)
        sched.add_request(Request("a", PROMPTS[0], GREEDY))
        sched.step()
        target.kill()
        updates = []
        deadline = time.monotonic() + 60  # past the 0.5 s recovery timeout; only bounds a hang
        while not any(u.finished for u in updates):
            assert time.monotonic() < deadline
            updates += sched.step().updates
            time.sleep(0.02)
        [last] = [u for u in updates if u.finished]
        assert last.error_kind == "unavailable" and "unavailable for longer than 0.5s" in last.error
        assert not sched.healthy
        sched.add_request(Request("b", PROMPTS[1], GREEDY))  # refused at once while it is gone
        assert [u.error_kind for u in sched.step().updates] == ["unavailable"]
        target.start()

        def probe() -> bool:  # what the scheduler thread does when idle: look for it when due
            if sched.has_work():
                sched.step()
            return sched.healthy

        # A look may still meet the channel's reconnect backoff: it is back once a look found it.
        assert wait_until(probe, timeout=60)
        sched.add_request(Request("c", PROMPTS[1], GREEDY))
        got = []
        while sched.running or sched.waiting:
            got += [t for u in sched.step().updates for t in u.token_ids]
        assert sched.healthy and len(got) == GREEDY.max_new_tokens
    finally:
        client.close()
        target.server.stop(None)


class Hanging:
    """A target that stops answering (like a SIGSTOPped process) while `hang` is set and until
    `replaced` is: however slow the machine, it never answers within the round deadline."""

    def __init__(self, inner):
        self.inner, self.hang, self.replaced = inner, threading.Event(), threading.Event()

    def info(self):
        return self.inner.info()

    def verify(self, tasks, finished):
        if self.hang.is_set():
            self.replaced.wait(120)
        return self.inner.verify(tasks, finished)


def test_a_hung_worker_is_treated_as_dead_and_its_requests_resume(cluster, uninterrupted):
    hanging = Hanging(cluster.target.worker)
    cluster.target.server.stop(None).wait()
    cluster.target.server, _ = target_server.serve(hanging, cluster.target.address)
    hung_at = []

    def hang():
        hanging.hang.set()
        hung_at.append(time.monotonic())

    def recover():  # the operator (or Ray) replaces the stuck worker with a fresh one
        hanging.replaced.set()
        cluster.target.server.stop(None).wait()
        cluster.target.start()

    try:
        out = run(cluster.scheduler, 3, hang, steps_between=1, after=recover)
    finally:
        hanging.replaced.set()
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == uninterrupted
    assert "no answer within 2s" in cluster.scheduler.target_health.last_error


# --- through the public server: health, and a kill while draining ---------------------------


def http_health(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


LONG = SamplingParams(max_new_tokens=200, ignore_eos=True)


def test_a_worker_ray_will_not_restart_fails_requests_at_once_and_health_follows(cluster):
    """The target dies and its supervisor says it is gone for good (Ray: max_restarts used up):
    its stream fails now, not after the 30 s recovery timeout; health says NOT_SERVING, new
    requests are refused with the reason; redeployed, health says SERVING again by itself."""
    gone = threading.Event()

    def resolve() -> str:
        if gone.is_set():
            raise WorkerGone("Ray will not restart specdec-target (max_restarts used up)")
        return cluster.target.address

    cluster.scheduler.target.resolve_address = resolve
    # The stream is still running when its target dies: the scheduler holds after its first round
    # until the target is gone.
    running = RoundGate()
    with run_server_in_thread(lambda: cluster.scheduler, None, on_round=running) as server:
        assert health_status(server.port) == health_pb2.HealthCheckResponse.SERVING
        client = GenerationClient(f"127.0.0.1:{server.port}")
        stream = client.generate_stream(PROMPTS[0], max_new_tokens=LONG.max_new_tokens, ignore_eos=True)
        next(stream)
        try:
            running.wait_held()
            gone.set()
            cluster.target.kill()
        finally:
            running.open()
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            list(stream)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        # Not the 30 s recovery timeout (a third of it, for a slow machine's margin).
        assert "will not be restarted" in failed.value.details() and time.monotonic() - t0 < 10
        assert wait_until(lambda: health_status(server.port) == health_pb2.HealthCheckResponse.NOT_SERVING)
        code, body = http_health(server.http_port)
        assert code == 503 and body["status"] == "failed" and "will not be restarted" in body["message"]
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(PROMPTS[1], max_new_tokens=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "max_restarts" in refused.value.details()

        cluster.target.start()  # deployed again: nobody sends a request, health comes back alone
        gone.clear()
        assert wait_until(lambda: health_status(server.port) == health_pb2.HealthCheckResponse.SERVING)
        assert len(client.generate(PROMPTS[1], max_new_tokens=5).token_ids) == 5
        client.close()


def test_a_worker_killed_while_the_server_drains_its_streams_still_finish(cluster, models):
    """SIGTERM-style drain starts while a stream runs, then the target dies and comes back: the
    stream finishes inside the grace period with the uninterrupted tokens, no new request gets in."""
    want = LocalEngine(models[0], draft=models[1], num_speculative_tokens=4, adaptive=False) \
        .generate([PROMPTS[0]], LONG)[0].token_ids
    config = dataclasses.replace(LOOPBACK_SERVER, grace_period=60.0)
    # The stream is still running when the drain starts and its target dies: the scheduler holds
    # after its first round until then; the target comes back only once the scheduler lost it.
    running = RoundGate()
    with run_server_in_thread(lambda: cluster.scheduler, None, config, on_round=running) as server:
        client = GenerationClient(f"127.0.0.1:{server.port}")
        stream = client.generate_stream(PROMPTS[0], max_new_tokens=LONG.max_new_tokens, ignore_eos=True)
        got = list(next(stream).token_ids)
        stopping = threading.Thread(target=server.stop)  # drains for up to 60 s
        try:
            stopping.start()
            assert wait_until(lambda: server.server.gate.draining)
            cluster.target.kill()
            with pytest.raises(grpc.RpcError) as refused:
                client.generate(PROMPTS[1], max_new_tokens=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()
        finally:
            running.open()
        assert wait_until(lambda: not cluster.scheduler.target_health.up)
        cluster.target.start()
        for response in stream:
            got += response.token_ids
        assert response.finish_reason == "length" and got == want
        stopping.join(30)
        assert not stopping.is_alive()  # the drain ended as soon as the stream did
        client.close()
