"""Target replicas behind one endpoint: routing, per-replica metrics and autoscaling, in process.

The scale decisions and the routing order are pure and tested alone; then a real server with two
in-process replicas serves many streams whose outputs must equal one engine's, and an in-process
autoscaler grows under a backed-up queue and shrinks when idle. Ray clusters with several nodes
(isolation when a replica's worker is killed, autoscaling through placement groups) are in
tests/test_replicas_ray.py.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from types import SimpleNamespace

import pytest

from coordinator.frontend.server import GenerationServer
from coordinator.frontend.server_thread import LOOPBACK_SERVER, ServerThread
from coordinator.replicas.router import Replica, pick_replica
from coordinator.replicas.scale_policy import ReplicaLoad, ScaleDecision, ScalePolicy
from specdec import LocalEngine, ServiceConfig
from specdec.client import GenerationClient
from specdec.config import ConfigError, ReplicaConfig
from specdec.params import SamplingParams
from specdec_app.embedded import LocalReplicaLauncher, LocalSchedulerFactory

from checkpoints import CONFIGS, build_checkpoint, perturbed_copy
from gates import Calls, RoundGate, wait_until

PROMPTS = [[3, 17, 42, 7, 99, 12, 5], [8, 8, 8, 21, 30, 8, 8, 8, 21], [150, 4], list(range(40, 60))] * 3
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=24, temperature=0.9, seed=77, ignore_eos=True)
PARAMS = [GREEDY if i % 2 == 0 else dataclasses.replace(SEEDED, seed=1000 + i) for i in range(len(PROMPTS))]


# --- the scale decision ---------------------------------------------------------------------------

def loads(*waiting_active, serving=True) -> list[ReplicaLoad]:
    return [ReplicaLoad(i, w, a, serving) for i, (w, a) in enumerate(waiting_active)]


def test_scale_up_only_after_every_replica_stayed_backed_up_for_the_window():
    policy = ScalePolicy(ReplicaConfig(count=1, max_replicas=3, scale_up_queue=2, scale_window=5.0))
    assert not policy.decide(100.0, loads((3, 5))).add  # backed up, but only just
    assert not policy.decide(104.0, loads((3, 5))).add
    assert policy.decide(105.0, loads((3, 5))).add
    # The new replica takes no load yet: no second add within the window after a change.
    assert not policy.decide(106.0, loads((3, 5), (0, 0))).add
    # One busy replica beside an idle one is the router's job, not a reason to grow.
    assert not policy.decide(120.0, loads((9, 12), (0, 1))).add


def test_scale_up_stops_at_max_and_counts_replicas_still_being_added():
    policy = ScalePolicy(ReplicaConfig(count=1, max_replicas=2, scale_up_queue=0, scale_window=1.0))
    policy.decide(0.0, loads((1, 1)))
    assert not policy.decide(2.0, loads((1, 1)), pending=1).add  # 1 + 1 pending = max
    assert not policy.decide(4.0, loads((1, 1), (1, 1))).add


def test_scale_down_the_newest_replica_idle_long_enough_never_below_min():
    policy = ScalePolicy(ReplicaConfig(count=1, min_replicas=1, max_replicas=3, scale_window=1.0,
                                       scale_down_idle=10.0))
    assert policy.decide(0.0, loads((0, 0), (0, 2), (0, 0))).remove is None
    assert policy.decide(9.0, loads((0, 0), (0, 2), (0, 0))).remove is None
    assert policy.decide(10.0, loads((0, 0), (0, 2), (0, 0))).remove == 2
    assert policy.decide(30.0, loads((0, 0), (0, 2))).remove == 0  # replica 1 is busy
    assert policy.decide(60.0, loads((0, 0))).remove is None  # min_replicas


def test_replica_settings_are_checked_where_they_are_built():
    with pytest.raises(ConfigError, match="max_replicas must be at least replicas"):
        ServiceConfig.from_settings(replicas=3, max_replicas=2)
    with pytest.raises(ConfigError, match="draft_placement"):
        ServiceConfig.from_settings(draft_placement="anywhere")
    config = ServiceConfig.from_settings(replicas=2, max_replicas=4, draft_replicas=2).replicas
    assert config.autoscaling and [config.draft_of(i) for i in range(4)] == [0, 1, 0, 1]
    assert [config.owns_draft(i) for i in range(4)] == [True, True, False, False]


# --- routing ---------------------------------------------------------------------------------------

class StubThread:
    def __init__(self, index: int):
        self.replica = index
        self.is_ready, self.failure, self.start_error = True, None, None


def routed(replicas: list[Replica], n: int) -> list[int]:
    """Route n requests in a row (each counts as waiting where it went)."""
    out, last = [], -1
    for _ in range(n):
        choice = pick_replica(replicas, last)
        choice.routed_since_report += 1
        out.append(last := choice.index)
    return out


def test_route_to_fewest_waiting_then_most_free_blocks_then_round_robin():
    a, b, c = (Replica(StubThread(i), kv_blocks_free=100) for i in range(3))
    assert routed([a, b, c], 6) == [0, 1, 2, 0, 1, 2]  # all alike: round-robin
    a, b = Replica(StubThread(0), kv_blocks_free=10), Replica(StubThread(1), kv_blocks_free=90)
    assert routed([a, b], 1) == [1]  # more free KV blocks
    a, b = Replica(StubThread(0), queue_depth=3, kv_blocks_free=90), Replica(StubThread(1), kv_blocks_free=10)
    assert routed([a, b], 3) == [1, 1, 1]  # fewer waiting first (routed ones count as waiting)


def test_route_around_a_replica_whose_target_is_down_or_that_drains():
    a, b, c = (Replica(StubThread(i), kv_blocks_free=50) for i in range(3))
    a.target_down, b.draining = True, True
    assert routed([a, b, c], 3) == [2, 2, 2]
    c.thread.failure = "gone for good"
    assert routed([a, b, c], 1) == [0]  # none serves: wait on one that may come back, not on a drained one


# --- two replicas in process ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = build_checkpoint(tmp_path_factory.mktemp("replica-target"), seed=0, initializer_range=0.1,
                              **CONFIGS["gqa_untied"])
    draft = perturbed_copy(target, tmp_path_factory.mktemp("replica-draft"), noise=0.2)
    return str(target), str(draft)


def service_config(models, **settings) -> ServiceConfig:
    return ServiceConfig.from_settings(target=models[0], draft=models[1], num_speculative_tokens=4, adaptive=False,
                                       kv_cache_blocks=96, kv_block_size=8, **settings)


def serve(config: ServiceConfig, launcher=None) -> tuple[ServerThread, list]:
    factories = [LocalSchedulerFactory(config) for _ in range(config.replicas.count)]
    server = GenerationServer(factories, None, LOOPBACK_SERVER, launcher=launcher, replica_config=config.replicas)
    handle = ServerThread(server)
    handle.start(wait_ready=True)
    return handle, factories


def generate_all(port: int, prompts, params) -> list[list[int]]:
    def one(i):
        with GenerationClient(f"127.0.0.1:{port}") as client:
            p = params[i]
            return client.generate(prompts[i], max_new_tokens=p.max_new_tokens, temperature=p.temperature,
                                   seed=p.seed, ignore_eos=True, timeout=120).token_ids
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def test_two_replicas_share_the_streams_and_match_one_engine(models):
    config = service_config(models, replicas=2)
    want = [o.token_ids for o in LocalEngine(config=dataclasses.replace(
        config, ray=dataclasses.replace(config.ray, enabled=False))).generate(PROMPTS, PARAMS)]
    handle, factories = serve(config)
    per_replica: dict[int, int] = {}
    handle.server.scheduler.on_round = lambda report: per_replica.__setitem__(
        report.replica, per_replica.get(report.replica, 0) + report.committed_tokens)
    try:
        assert generate_all(handle.port, PROMPTS, PARAMS) == want
        # The hook runs after a round's updates went out: the last rounds are counted soon after.
        assert wait_until(lambda: sum(per_replica.values()) >= sum(len(w) for w in want)), per_replica
        assert set(per_replica) == {0, 1} and all(n > 0 for n in per_replica.values()), per_replica
        assert sum(per_replica.values()) == sum(len(w) for w in want)
        metrics = handle.server.metrics.registry.get_sample_value
        for replica in ("0", "1"):
            assert metrics("specdec_kv_blocks_total", {"replica": replica}) == 96
        assert wait_until(lambda: not any(f.target_worker.cache.allocator.num_used for f in factories)), \
            "KV blocks still in use after every stream ended"
    finally:
        handle.stop()


def test_in_process_autoscaling_adds_a_replica_under_load_and_drains_it_when_idle(models):
    config = service_config(models, replicas=1, max_replicas=2, max_batch_size=1, scale_up_queue=0,
                            scale_window=0.5, scale_down_idle=1.0)
    launcher = LocalReplicaLauncher(config)
    handle, _ = serve(config, launcher)
    router = handle.server.scheduler
    router.tick_s = 0.1
    # However fast the rounds, replica 0's queue stays backed up until the test has seen the new
    # replica serve: replica 0 holds after its first round until all six requests reached it, then
    # after the round whose report (the router's view of its load) has the other five waiting,
    # until the gate opens. Five, not just some: new requests must find replica 0 the busier one
    # (on a tie the router prefers free KV blocks, and a new replica reports none before its
    # first round).
    busy_requests = 6
    backed_up = RoundGate(holds=lambda report: report.replica == 0 and report.queue_depth == busy_requests - 1)
    # An idle replica is removed only once the test is done with it (it may look long after the
    # new replica came up): until then removals are suppressed.
    removals_allowed = threading.Event()
    decide = router.policy.decide

    def decide_unless_removal_held(now, loads, pending=0):
        decision = decide(now, loads, pending)
        return decision if decision.remove is None or removals_allowed.is_set() else ScaleDecision()

    router.policy.decide = decide_unless_removal_held
    served_by: set[int] = set()

    def on_round(report):
        if report.ran:
            served_by.add(report.replica)
        if report.replica == 0 and not backed_up.is_open:
            submits.wait_count(busy_requests)
            backed_up(report)

    try:
        long = SamplingParams(max_new_tokens=120, ignore_eos=True)
        with Calls(router, "submit") as submits, concurrent.futures.ThreadPoolExecutor(1) as pool:
            router.on_round = on_round
            busy = pool.submit(generate_all, handle.port, [PROMPTS[0]] * busy_requests, [long] * busy_requests)
            backed_up.wait_held()
            assert wait_until(lambda: len(router.replicas) == 2 and router.replicas[1].serving), \
                "no replica was added while requests waited"
            assert set(launcher.factories) == {1}
            # Requests stay where they were routed; new ones go to the new, emptier replica (and are
            # served while replica 0 is still held).
            assert generate_all(handle.port, PROMPTS[:2], [GREEDY] * 2)
            assert served_by == {0, 1} and not busy.done()
            backed_up.open()
            assert len(busy.result(timeout=120)) == busy_requests
        removals_allowed.set()
        assert wait_until(lambda: len(router.replicas) == 1, timeout=60), "the idle replica was never removed"
        assert launcher.factories == {} and [r.index for r in router.replicas] == [0]
        assert generate_all(handle.port, PROMPTS[:2], [GREEDY] * 2)  # still serving after
    finally:
        backed_up.open()
        handle.stop()


def test_no_replica_is_picked_when_all_are_draining():
    replica = Replica(SimpleNamespace(replica=0, is_ready=True, failure=None, start_error=None), draining=True)
    assert pick_replica([replica]) is None


# --- a request moved between replicas --------------------------------------------------------------

@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_a_request_evicted_midway_and_adopted_by_another_scheduler_gives_the_same_tokens(models, policy):
    """What the router does when a replica's target is lost and another serves: the same tokens
    follow, greedy and seeded sampled, with the adaptive policy's per-request state carried."""
    from coordinator.rounds.request import Request

    from checkpoints import cheap_drafting_policy, use_policy

    config = service_config(models)
    engine_config = dataclasses.replace(config, ray=dataclasses.replace(config.ray, enabled=False))
    want = [o.token_ids for o in use_policy(LocalEngine(config=engine_config), policy).generate(PROMPTS[:4],
                                                                                                  PARAMS[:4])]
    source, destination = LocalSchedulerFactory(config)(), LocalSchedulerFactory(config)()
    if policy == "adaptive":
        source.policy, destination.policy = cheap_drafting_policy(), cheap_drafting_policy()
    got = {f"r{i}": [] for i in range(4)}
    for i in range(4):
        source.add_request(Request(f"r{i}", PROMPTS[i], PARAMS[i]))
    for _ in range(3):
        for u in source.step().updates:
            got[u.req_id] += u.token_ids
    for i in range(4):
        destination.adopt(*source.evict(f"r{i}"))
    assert not source.running and source.evict("r0") is None
    while destination.has_work() or destination.running:
        for u in destination.step().updates:
            got[u.req_id] += u.token_ids
    assert [got[f"r{i}"] for i in range(4)] == want
    source.step()  # delivers the releases
    for scheduler in (source, destination):
        assert scheduler.kv_blocks_used == 0
