"""A worker process dies under load: Ray restarts it and every in-flight stream carries on after a
pause, with exactly the tokens of an uninterrupted run (greedy and seeded sampled).

One Ray instance and one deployment for the module (Ray start-up is the slow part here). The
worker processes are killed with SIGKILL, as a crash would kill them, not through Ray. The Ray
node carries the custom resources of the KubeRay layout (k8s/base/raycluster.yaml: specdec_coordinator,
specdec_target, specdec_draft, one each), so the actors are placed the way they are in a cluster,
and a restarted worker must get its resource back.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest

ray = pytest.importorskip("ray")

from specdec import LocalEngine, ServiceConfig  # noqa: E402
from specdec.config import NGRAM, DraftConfig  # noqa: E402
from specdec.params import SamplingParams  # noqa: E402
from specdec.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402

from checkpoints import CONFIGS, build_checkpoint, perturbed_copy  # noqa: E402
from gates import wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [3, 17, 42, 5, 99, 7, 3, 17]
MAX_POS = 1024
K = 4
RECOVERY_S = 60
HANG_S = 3.0  # the round deadline of this module's deployment


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("fault-tolerance")
    target = build_checkpoint(base / "target", seed=0, max_position_embeddings=MAX_POS, **CONFIGS["gqa_untied"])
    draft = perturbed_copy(target, base / "draft", noise=0.1)
    return target, draft


@pytest.fixture(scope="module")
def deployment(models):
    from specdec_app.ray_actors import launch

    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", namespace="specdec-ft",
             runtime_env={"env_vars": env},
             resources={"specdec_coordinator": 1, "specdec_target": 1, "specdec_draft": 1})
    try:
        target, draft = models
        # K fixed: every round uses the draft, so both workers' deaths are felt at once.
        dep = launch(ServiceConfig.from_settings(target=str(target), draft=str(draft), num_speculative_tokens=K,
                                                 adaptive=False, host="127.0.0.1", port=0, http_port=0,
                                                 name="specdec-ft", worker_cpus=0.5, worker_round_timeout=HANG_S))
        try:
            yield dep
        finally:
            dep.drain_and_stop(grace_s=1, timeout_s=15)
    finally:
        ray.shutdown()


# ~1000 tokens: the stream is still running when its worker dies. The workers are other processes
# (no gate reaches them): >= 200 rounds of two RPCs each take >= 0.3 s even on a machine 10x faster
# than ours, and the kill follows the streams' first responses within a millisecond.
LONG = MAX_POS - len(PROMPT) - 16
STREAMS = {"greedy": dict(), "seeded": dict(temperature=0.9, seed=2024)}


@pytest.fixture(scope="module")
def expected(models):
    target, draft = models
    engine = LocalEngine(str(target), str(draft), num_speculative_tokens=K, adaptive=False)
    return {name: engine.generate([PROMPT], SamplingParams(max_new_tokens=LONG, ignore_eos=True, **sampling))[0]
            .token_ids for name, sampling in STREAMS.items()}


def _request(max_new_tokens: int, **sampling) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True)
    for name, value in sampling.items():
        setattr(request.sampling, name, value)
    return request


@pytest.mark.parametrize("role,how", [("target", signal.SIGKILL), ("draft", signal.SIGKILL),
                                      ("target", signal.SIGSTOP)])
def test_worker_killed_mid_stream_the_streams_carry_on(deployment, expected, role, how):
    """SIGKILL a worker (or SIGSTOP it past the round deadline) while a greedy and a seeded sampled
    stream run: Ray restarts it on the same address, the coordinator resumes both, and each
    returns exactly the uninterrupted tokens."""
    actor = deployment.target if role == "target" else deployment.draft
    old_address = deployment.target_address if role == "target" else deployment.draft_address
    pid = ray.get(actor.pid.remote(), timeout=30)
    t0 = time.monotonic()
    with grpc.insecure_channel(f"127.0.0.1:{deployment.port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        streams = {name: stub.Generate(_request(LONG, **sampling), timeout=RECOVERY_S + 60)
                   for name, sampling in STREAMS.items()}
        got = {name: list(next(stream).token_ids) for name, stream in streams.items()}  # both running
        os.kill(pid, how)
        for name, stream in streams.items():
            for response in stream:  # no error: a pause, then the rest
                got[name] += response.token_ids
            assert response.finish_reason == "length"
    assert got == expected
    assert ray.get(actor.pid.remote(), timeout=30) != pid  # Ray restarted the process...
    assert ray.get(actor.address.remote(), timeout=10) == old_address  # ...on the same address
    snapshot = ray.get(deployment.coordinator.metrics_snapshot.remote(), timeout=10)
    assert snapshot["resumed"].get(role, 0) >= 2, snapshot["resumed"]
    # Releases go with the next round or an idle flush.
    assert wait_until(lambda: ray.get(deployment.coordinator.metrics_snapshot.remote(), timeout=10)
                      ["kv_blocks_used"] == 0), "target KV blocks still in use after the requests finished"
    print(f"{role}: both streams done {time.monotonic() - t0:.1f}s after the kill")


def test_actors_take_the_cluster_custom_resources(deployment):
    from specdec_app import ray_cluster

    # Each actor holds its node's one unit (after the restarts above too).
    available = ray.available_resources()
    for name in ("specdec_coordinator", "specdec_target", "specdec_draft"):
        assert available.get(name, 0) == 0, (name, available)
    with pytest.raises(TimeoutError, match="specdec_nope"):
        ray_cluster.wait_for_resources(["specdec_target", "specdec_nope"], timeout_s=0.1, poll_s=0.05)

    # Fixed worker ports for non-loopback binds (the NetworkPolicy opens only those); free ports on loopback.
    assert ray_cluster.worker_port("node-ip", 50061) == 50061
    assert ray_cluster.worker_port("0.0.0.0", 50072) == 50072
    assert ray_cluster.worker_port("127.0.0.1", 50072) not in (50072, 0)


def test_grpc_clients_after_a_worker_restart_or_move():
    """No Ray: a target stream that died between rounds fails only rounds that continue requests;
    the restarted worker gets first rounds on a fresh stream; a worker that moved is followed."""
    from coordinator.rounds.errors import WorkerUnavailable
    from coordinator.rounds.grpc_clients import GrpcDraftClient, GrpcTargetClient
    from draft_worker import grpc_server as draft_server
    from draft_worker.worker import DraftWorker
    from specdec.round_types import DraftTask, VerifyOutcome, VerifyResult, VerifyTask
    from target_worker import grpc_server as target_server

    greedy = SamplingParams()

    class FakeTarget:
        def verify(self, tasks, finished):
            return VerifyResult([VerifyOutcome(t.req_id, 0, [1]) for t in tasks], 0, 8)

    def wait_broken(client):
        assert wait_until(client._call.done)

    server, port = target_server.serve(FakeTarget())
    client = GrpcTargetClient(f"127.0.0.1:{port}")
    try:
        assert client.verify([VerifyTask("a", [1, 2], [], None, greedy)], []).outcomes[0].tokens == [1]
        for _ in range(2):  # the worker restarts between rounds, on the same address
            server.stop(None).wait()
            wait_broken(client)
            server, _ = target_server.serve(FakeTarget(), f"127.0.0.1:{port}")
            client.verify([VerifyTask("b", [1], [], None, greedy)], [])  # opens a stream, then breaks it
            server.stop(None).wait()
            wait_broken(client)
            server, _ = target_server.serve(FakeTarget(), f"127.0.0.1:{port}")
            with pytest.raises(WorkerUnavailable, match="target worker unavailable .*lost since the last round"):
                client.verify([VerifyTask("b", [], [], None, greedy)], [])  # continues b: its state is gone
            # First rounds only (each carries its prompt): sent on a fresh stream right away.
            assert client.verify([VerifyTask("c", [1, 2], [], None, greedy)], ["b"]).outcomes[0].req_id == "c"
            assert client.address == f"127.0.0.1:{port}"
    finally:
        client.close()
        server.stop(None)

    first, first_port = draft_server.serve(DraftWorker.from_config(DraftConfig(model=NGRAM)))
    current = {"address": f"127.0.0.1:{first_port}"}
    draft = GrpcDraftClient(current["address"])
    draft.resolve_address = lambda: current["address"]
    second = None
    try:
        draft.propose([DraftTask("a", [1, 2, 1, 2], 2, greedy)], [])
        first.stop(None).wait()
        # restarted elsewhere
        second, second_port = draft_server.serve(DraftWorker.from_config(DraftConfig(model=NGRAM)))
        current["address"] = f"127.0.0.1:{second_port}"
        with pytest.raises(WorkerUnavailable, match=f"draft worker unavailable .*127.0.0.1:{first_port}"):
            draft.propose([DraftTask("a", [1], 2, greedy)], [])
        draft.propose([DraftTask("a", [1], 2, greedy)], [])  # unknown to the new worker: a fresh sequence
        assert draft.address == current["address"]
    finally:
        draft.close()
        first.stop(None)
        if second is not None:
            second.stop(None)


def test_serve_waits_for_worker_nodes_and_never_shares_a_gpu_there(deployment, monkeypatch):
    from specdec_app import ray_cluster
    from specdec_app.serve_messages import ServeError
    from specdec_app.serve_ray import _plan_gpus

    def config(draft):
        return ServiceConfig.from_settings(device="cuda", worker_wait=0.1, draft=draft)

    # specdec_* resources present and the worker nodes joined: one GPU each, no waiting.
    assert _plan_gpus(ray, config("/models/draft"), started=False) is None
    # A cluster that lacks a worker group's resource: a clear error after --worker-wait.
    real = ray.cluster_resources
    monkeypatch.setattr(ray, "cluster_resources",
                        lambda: {k: v for k, v in real().items() if k != ray_cluster.DRAFT_RESOURCE})
    with pytest.raises(ServeError, match="specdec_draft .*worker pods"):
        _plan_gpus(ray, config("/models/draft"), started=False)
    assert _plan_gpus(ray, config(NGRAM), started=False) is None  # n-gram drafting needs no draft node
