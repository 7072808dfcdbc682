"""Replicas on a local multi-node Ray cluster (ray.cluster_utils.Cluster): a head node that carries
`specdec_coordinator` and worker nodes that carry `specdec_target` / `specdec_draft`, as the
KubeRay manifests lay them out (one per pod), so each replica's placement group lands on a node of
its own.

- Isolation: two replicas serve many streams (greedy and seeded sampled); one replica's target
  actor is SIGKILLed mid-stream. Its requests go on on the other replica; every stream ends with
  the output of an uninterrupted run, no KV block stays in use on either replica, and the killed
  replica serves again once Ray restarted it.
- Autoscaling: one replica, max two; requests pile up, the coordinator adds a replica (its
  placement group takes the second node); when the load stops it drains and removes it.
- No test leaves a placement group behind (a leftover one holds a node's resources and the next
  test's replica waits for them forever): stopping while a replica is being added stops it too,
  and a deployment's kill removes whatever placement groups of its replicas are left.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from specdec import LocalEngine, ServiceConfig  # noqa: E402
from specdec.client import GenerationClient  # noqa: E402
from specdec.params import SamplingParams  # noqa: E402

from checkpoints import CONFIGS, build_checkpoint, perturbed_copy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[3, 17, 42, 7, 99, 12, 5], [8, 8, 8, 21, 30, 8, 8, 8, 21], [150, 4], list(range(40, 60))] * 4
PARAMS = [SamplingParams(max_new_tokens=60, ignore_eos=True) if i % 2 == 0 else
          SamplingParams(max_new_tokens=60, temperature=0.9, seed=500 + i, ignore_eos=True)
          for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = build_checkpoint(tmp_path_factory.mktemp("ray-replica-target"), seed=0, initializer_range=0.1,
                              max_position_embeddings=512, **CONFIGS["gqa_untied"])
    draft = perturbed_copy(target, tmp_path_factory.mktemp("ray-replica-draft"), noise=0.2)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def cluster():
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"specdec_coordinator": 1}, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"specdec_target": 1, "specdec_draft": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="specdec", logging_level="WARNING", runtime_env={"env_vars": env})
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(autouse=True)
def no_placement_group_outlives_its_test():
    """After each test every placement group is removed (removal is asynchronous: waited for)."""
    yield
    if not ray.is_initialized():
        return
    from ray.util.placement_group import placement_group_table

    deadline = time.monotonic() + 30
    while live := sorted(g["name"] for g in placement_group_table().values() if g["state"] != "REMOVED"):
        assert time.monotonic() < deadline, f"placement groups left behind: {live}"
        time.sleep(0.2)


def config_for(models, name: str, **settings) -> ServiceConfig:
    return ServiceConfig.from_settings(
        target=models[0], draft=models[1], num_speculative_tokens=4, adaptive=False, kv_cache_blocks=128,
        kv_block_size=8, host="127.0.0.1", port=0, http_port=0, name=name, worker_cpus=0.5, max_restarts=-1,
        worker_round_timeout=5.0, worker_recovery_timeout=120.0, **settings)


def stream_all(port: int, prompts, params, on_first_tokens=None) -> list[list[int]]:
    def one(i):
        with GenerationClient(f"127.0.0.1:{port}") as client:
            p = params[i]
            tokens = []
            for chunk in client.generate_stream(prompts[i], max_new_tokens=p.max_new_tokens, temperature=p.temperature,
                                                seed=p.seed, ignore_eos=True, timeout=240):
                tokens += chunk.token_ids
                if on_first_tokens is not None and len(tokens) >= 8:
                    on_first_tokens()
            return tokens
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def snapshot(deployment) -> dict:
    return ray.get(deployment.coordinator.metrics_snapshot.remote(), timeout=30)


@pytest.mark.timeout(400)
def test_killing_one_replicas_target_leaves_the_other_untouched_and_every_stream_exact(cluster, models):
    from specdec_app.ray_actors import launch

    config = config_for(models, "specdec-iso", replicas=2)
    engine = LocalEngine(config=dataclasses.replace(config, ray=dataclasses.replace(config.ray, enabled=False)))
    want = [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
    deployment = launch(config)
    try:
        nodes = {r.info["node_id"] for r in deployment.replicas}
        assert len(deployment.replicas) == 2 and len(nodes) == 2  # a node each (their placement groups)
        victim = deployment.replicas[1]
        pid = ray.get(victim.target.pid.remote(), timeout=30)
        killed, lock = [], threading.Lock()

        def kill_once():
            with lock:
                if not killed:
                    killed.append(pid)
                    os.kill(pid, 9)

        got = stream_all(deployment.port, PROMPTS, PARAMS, on_first_tokens=kill_once)
        assert killed and got == want
        snap = snapshot(deployment)
        routing = ray.get(deployment.coordinator.routing.remote(), timeout=30)
        # Replica 0 served all along, so replica 1's requests went on there rather than wait.
        assert set(snap["replicas"]) == {0, 1} and routing["moved_requests"] >= 1, (snap, routing)
        deadline = time.monotonic() + 120
        while True:  # Ray restarts it (its requests did not wait for that)
            try:
                assert ray.get(victim.target.pid.remote(), timeout=60) != pid
                break
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                assert time.monotonic() < deadline, "the killed target was never restarted"
                time.sleep(0.5)
        # The restarted replica takes requests again (once its idle probe found the worker back).
        deadline = time.monotonic() + 60
        while "target" in snapshot(deployment)["replicas"][1]["workers_down"]:
            assert time.monotonic() < deadline, "replica 1 never saw its restarted target"
            time.sleep(0.2)
        before = snapshot(deployment)["replicas"][1]["rounds"]
        assert stream_all(deployment.port, PROMPTS[:4], PARAMS[:4]) == want[:4]
        deadline = time.monotonic() + 30
        while True:
            replicas = snapshot(deployment)["replicas"]
            if all(r["kv_blocks_used"] == 0 and r["running"] == 0 for r in replicas.values()):
                break
            assert time.monotonic() < deadline, f"KV blocks still in use: {replicas}"
            time.sleep(0.2)
        assert replicas[1]["rounds"] > before
    finally:
        deployment.drain_and_stop(grace_s=1, timeout_s=30)


@pytest.mark.timeout(400)
def test_autoscaling_adds_a_replica_on_the_second_node_under_load_and_removes_it_when_idle(cluster, models):
    from specdec_app.ray_actors import launch

    config = config_for(models, "specdec-scale", replicas=1, max_replicas=2, max_batch_size=2, scale_up_queue=0,
                        scale_window=1.0, scale_down_idle=3.0)
    deployment = launch(config)
    try:
        count = lambda: len(ray.get(deployment.coordinator.routing.remote(), timeout=30)["replicas"])  # noqa: E731
        assert count() == 1
        # Eight clients send 200-token requests back to back until the test has seen the new
        # replica: two run at a time, so requests wait on replica 0 however fast its rounds (a
        # fixed amount of work could end within the scale-up window on a fast machine), and the
        # new replica has work (is not idle, so not removed) while the test looks at it.
        seen_added = threading.Event()

        def load_until_seen(i: int) -> list[int]:
            lengths = []
            with GenerationClient(f"127.0.0.1:{deployment.port}") as client:
                while not seen_added.is_set():
                    lengths.append(len(client.generate(PROMPTS[i], max_new_tokens=200, ignore_eos=True,
                                                       timeout=240).token_ids))
            return lengths

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            load = [pool.submit(load_until_seen, i) for i in range(8)]
            try:
                deadline = time.monotonic() + 120
                while count() < 2:
                    assert time.monotonic() < deadline, "no replica was added while requests waited"
                    time.sleep(0.5)
                added = ray.get_actor("specdec-scale-target-1", namespace="specdec")
                assert ray.get(added.ready.remote(), timeout=60)["node_ip"]
            finally:
                seen_added.set()
            for client_load in load:
                lengths = client_load.result(timeout=240)
                assert lengths and all(n == 200 for n in lengths), lengths
        deadline = time.monotonic() + 120
        while count() > 1:
            assert time.monotonic() < deadline, "the idle replica was never removed"
            time.sleep(0.5)
        with pytest.raises(ValueError):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # its actor goes with it
                ray.get_actor("specdec-scale-target-1", namespace="specdec")
                time.sleep(0.5)
    finally:
        deployment.drain_and_stop(grace_s=1, timeout_s=30)


@pytest.mark.timeout(300)
def test_two_replicas_share_one_draft_worker_and_stay_exact(cluster, models):
    from specdec_app.ray_actors import launch

    config = config_for(models, "specdec-shared", replicas=2, draft_replicas=1)
    engine = LocalEngine(config=dataclasses.replace(config, ray=dataclasses.replace(config.ray, enabled=False)))
    want = [o.token_ids for o in engine.generate(PROMPTS[:8], PARAMS[:8])]
    deployment = launch(config)
    try:
        first, second = deployment.replicas
        assert second.draft is None and second.draft_name == first.draft_name == "specdec-shared-draft"
        assert second.draft_address == first.draft_address
        assert stream_all(deployment.port, PROMPTS[:8], PARAMS[:8]) == want
        assert all(r["rounds"] > 0 for r in snapshot(deployment)["replicas"].values())
    finally:
        deployment.drain_and_stop(grace_s=1, timeout_s=30)


def test_stopping_while_a_replica_loads_stops_it_and_no_replica_starts_after(models, monkeypatch):
    """The autoscaler adds a replica on a thread of its own; the deployment stops while that replica
    loads its models. stop_all stops it (its placement group would otherwise outlive the
    coordinator: Ray keeps placement groups for the life of the job), and a later add starts
    nothing. Ray itself is faked: gates, not timing, order the two threads."""
    from specdec_app import ray_replicas

    asked, stopped, killed = threading.Event(), [], threading.Event()

    def start(config, index, cluster, shared_draft=None):
        asked.set()
        return ray_replicas.ReplicaActors(index, target=f"target-{index}", target_name=f"target-{index}")

    def wait(replica, timeout_s, shared=None):  # loading, until its actors are killed
        assert killed.wait(timeout=120), "the replica being added was never stopped"
        raise RuntimeError("its actors were killed")

    def stop(replica):
        stopped.append(replica.index)
        killed.set()

    monkeypatch.setattr(ray_replicas, "start_replica", start)
    monkeypatch.setattr(ray_replicas, "wait_replica", wait)
    monkeypatch.setattr(ray_replicas, "stop_replica", stop)
    monkeypatch.setattr(ray_replicas.ray, "cluster_resources", dict)
    launcher = ray_replicas.RayReplicaLauncher(config_for(models, "specdec-launcher", max_replicas=3), [],
                                               make_factory=lambda spec: spec)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        adding = pool.submit(launcher.add, 1)
        try:
            assert asked.wait(timeout=120)
            launcher.stop_all()
            assert stopped == [1]  # by stop_all, while add still waited
        finally:
            killed.set()  # (a failed assertion must not leave the thread waiting)
        with pytest.raises(RuntimeError, match="killed"):
            adding.result(timeout=120)
    assert launcher.started == {} and stopped == [1]  # stopped once
    asked.clear()
    with pytest.raises(RuntimeError, match="stopping"):
        launcher.add(2)
    assert not asked.is_set()


def test_a_deployments_leftover_placement_groups_are_removed_by_name(cluster):
    """What Deployment.kill sweeps after a coordinator that died mid-add: placement groups named
    after the deployment's replicas, with no actor. Those of this deployment go; another's stay."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from specdec_app.ray_replicas import remove_leftover_groups

    names = ["specdec-sweep-replica", "specdec-sweep-replica-4", "specdec-sweepy-replica-1", "other-replica"]
    groups = {name: placement_group([{"CPU": 0.01}], name=name) for name in names}
    try:
        assert sorted(remove_leftover_groups("specdec-sweep")) == ["specdec-sweep-replica", "specdec-sweep-replica-4"]
        assert remove_leftover_groups("specdec-sweep") == []
    finally:
        for name in ("specdec-sweepy-replica-1", "other-replica"):
            remove_placement_group(groups[name])


def test_removing_a_replica_launch_started_stops_its_actors(models, monkeypatch):
    """Autoscaling down to min_replicas may drain a replica that `launch` started (not the
    launcher): the launcher finds its actors by name from its spec and stops them, so its placement
    group does not hold a node for the rest of the job. Ray is faked."""
    from specdec_app import ray_replicas

    stopped = []
    monkeypatch.setattr(ray_replicas, "stop_replica", lambda replica: stopped.append(replica.target_name))
    monkeypatch.setattr(ray_replicas.ray, "get_actor", lambda name, namespace=None: f"handle of {name}")
    spec = {"index": 1, "target_name": "specdec-down-target-1", "target_address": "127.0.0.1:1"}
    launcher = ray_replicas.RayReplicaLauncher(config_for(models, "specdec-down", min_replicas=1, replicas=2),
                                               [spec], make_factory=lambda spec: spec)
    launcher.remove(1)
    assert stopped == ["specdec-down-target-1"] and launcher.specs == {}
