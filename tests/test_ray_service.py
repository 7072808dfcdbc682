"""The service on Ray, end to end: actors, real gRPC, metrics, and `specdec serve` draining on SIGTERM.

One Ray instance for the whole module (ray.init without the dashboard: ~5 s here instead of ~9 s).
The SIGTERM test runs `specdec serve --ray-address <this module's cluster>` as a subprocess: it
exercises the real command, actors included, without paying for a second Ray start-up.
"""
from __future__ import annotations

import concurrent.futures
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

ray = pytest.importorskip("ray")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from coordinator.frontend.server import SERVICE_NAME  # noqa: E402
from coordinator.telemetry.metrics import RoundMetrics  # noqa: E402
from specdec import LocalEngine, ServiceConfig  # noqa: E402
from specdec.config import SHIPPED_DRAFT, SHIPPED_TARGET  # noqa: E402
from specdec.params import SamplingParams  # noqa: E402
from specdec.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402

from checkpoints import CONFIGS, build_checkpoint, perturbed_copy  # noqa: E402
from gates import wait_until  # noqa: E402
from test_near_ties import NEW_TOKENS, scan_near_ties  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [3, 17, 42, 5, 99, 7, 3, 17]
MAX_POS = 1024  # room for a long request in the SIGTERM test


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("ray-service")
    target = build_checkpoint(base / "target", seed=0, max_position_embeddings=MAX_POS, **CONFIGS["gqa_untied"])
    draft = perturbed_copy(target, base / "draft", noise=0.1)  # accepts some, rejects some
    return target, draft


@pytest.fixture(scope="module")
def ray_cluster():
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", namespace="specdec-test",
             runtime_env={"env_vars": env})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def deployment(ray_cluster, models):
    from specdec_app.ray_actors import launch

    target, draft = models
    dep = launch(ServiceConfig.from_settings(target=str(target), draft=str(draft), num_speculative_tokens=4,
                                             adaptive=False, host="127.0.0.1", port=0, http_port=-1,
                                             name="specdec-test",
                                             worker_cpus=0.5))
    yield dep
    dep.drain_and_stop(grace_s=2)


def generate(port: int, max_new_tokens: int, k: int | None = None, timeout: float = 60):
    request = generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True)
    if k is not None:
        request.num_speculative_tokens = k
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        responses = list(stub.Generate(request, timeout=timeout))
    return [t for r in responses for t in r.token_ids], responses[-1]


def test_actors_serve_the_local_engine_tokens(deployment, models):
    target, draft = models
    # Named actors in the specdec namespace; workers on loopback only.
    for role in ("target", "draft", "coordinator"):
        assert ray.get_actor(f"specdec-test-{role}", namespace="specdec") is not None
    assert deployment.target_address.startswith("127.0.0.1:")
    assert deployment.draft_address.startswith("127.0.0.1:")

    tokens, last = generate(deployment.port, 40)
    expected = LocalEngine(str(target), str(draft), num_speculative_tokens=4, adaptive=False).generate(
        [PROMPT], SamplingParams(max_new_tokens=40, ignore_eos=True))[0]
    assert tokens == expected.token_ids
    assert last.finish_reason == "length"
    assert last.stats.generated_tokens == 40
    assert last.stats.HasField("acceptance_rate")
    assert last.stats.acceptance_rate == pytest.approx(expected.stats.acceptance_rate)

    # The metrics callback ran in the coordinator actor, exporting to Ray.
    snap = ray.get(deployment.coordinator.metrics_snapshot.remote())
    assert snap["exporting"] is True
    assert snap["generated_tokens"] >= 40
    assert snap["rounds"] >= last.stats.rounds
    assert snap["finished"].get("length", 0) >= 1
    assert 0 < snap["proposed"] and 0 <= snap["accepted"] <= snap["proposed"]
    assert {"draft", "verify", "total", "coordinator"} <= set(snap["round_seconds"])
    assert snap["kv_blocks_total"] > 0

    # The coordinator actor serves the HTTP API beside gRPC, on the same scheduler.
    base = f"http://127.0.0.1:{deployment.http_port}"
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    reply = httpx.post(f"{base}/v1/completions", json={"model": target.name, "prompt": PROMPT, "max_tokens": 3,
                                                        "temperature": 0}).json()
    assert reply["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 3, "total_tokens": len(PROMPT) + 3}
    assert "specdec_generated_tokens_total" in httpx.get(f"{base}/metrics").text


def test_overlapped_drafting_on_ray_actors_serves_the_serial_tokens(ray_cluster, models):
    """--overlap under Ray: the coordinator actor pre-drafts over gRPC while the target actor
    verifies; greedy and seeded sampled output equal the serial in-process engine's, pre-drafts
    were sent (whether any is kept depends on this random pair's guesses), and a cancelled
    stream leaves no KV blocks behind."""
    from specdec_app.ray_actors import launch

    target, draft = models
    dep = launch(ServiceConfig.from_settings(target=str(target), draft=str(draft), num_speculative_tokens=4,
                                             overlap=True, host="127.0.0.1", port=0, http_port=-1,
                                             name="specdec-overlap", worker_cpus=0.25))
    try:
        serial = LocalEngine(str(target), str(draft), num_speculative_tokens=4)
        tokens, _ = generate(dep.port, 40)
        assert tokens == serial.generate([PROMPT], SamplingParams(max_new_tokens=40, ignore_eos=True))[0].token_ids
        request = generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=30, ignore_eos=True,
                                                 sampling=generation_pb2.SamplingOptions(temperature=0.8, seed=11))
        with grpc.insecure_channel(f"127.0.0.1:{dep.port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            sampled = [t for r in stub.Generate(request, timeout=60) for t in r.token_ids]
            stream = stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=400,
                                                                  ignore_eos=True), timeout=60)
            next(stream)
            stream.cancel()
        params = SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.8, seed=11)
        assert sampled == serial.generate([PROMPT], params)[0].token_ids
        # Releases go with the next round or an idle flush.
        snapshot = lambda: ray.get(dep.coordinator.metrics_snapshot.remote(), timeout=10)  # noqa: E731
        assert wait_until(lambda: snapshot()["kv_blocks_used"] == 0), \
            "target KV blocks still in use after the cancelled stream"
        snap = snapshot()
        assert snap["predraft_tokens"] > 0 and 0 <= snap["predraft_kept"] <= snap["predraft_tokens"]  # pre-drafts sent
    finally:
        dep.drain_and_stop(grace_s=2)


def test_round_callback_with_and_without_ray(models):
    """The callback on a real scheduler: exact counts; a no-op export when Ray is absent."""
    target, draft = models
    engine = LocalEngine(str(target), str(draft), num_speculative_tokens=3)
    quiet = RoundMetrics(export=False)
    exported = RoundMetrics("specdec-unit")  # Ray is initialised in this process here
    assert not quiet.exporting
    from coordinator.rounds.request import Request

    sched = engine.scheduler
    sched.add_request(Request("a", PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True)))
    sched.add_request(Request("b", PROMPT[:3], SamplingParams(max_new_tokens=5, ignore_eos=True)))
    generated, finished = 0, {}
    while sched.has_work():
        report = sched.step()
        for callback in (quiet, exported):
            callback(report)
        generated += report.committed_tokens
        for u in report.updates:
            if u.finished:
                finished[u.req_id] = u.stats
    snap = quiet.snapshot()
    assert snap["generated_tokens"] == generated == 17
    assert snap["proposed"] == sum(s.proposed for s in finished.values())
    assert snap["accepted"] == sum(s.accepted for s in finished.values())
    assert snap["finished"] == {"length": 2}
    assert snap["kv_blocks_used"] == 0 and snap["running"] == 0 and snap["queue_depth"] == 0
    assert exported.snapshot()["generated_tokens"] == 17
    exported.close()


def health_status(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def _reader(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _wait_line(lines: queue.Queue, needle: str, timeout: float, seen: list[str]) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            line = lines.get(timeout=max(end - time.monotonic(), 0.01))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"no {needle!r} line in time; output so far:\n" + "\n".join(seen))


def test_serve_drains_in_flight_requests_on_sigterm(ray_cluster, deployment, models, tmp_path):
    """`specdec serve` (joining this module's Ray cluster): SIGTERM mid-request -> the request
    completes, new requests are refused, the process exits 0."""
    from specdec_app.ray_cluster import free_port

    target, draft = models
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    stderr_path = tmp_path / "serve.stderr"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specdec_app.cli", "serve", "--target", str(target), "--draft", str(draft),
             "--host", "127.0.0.1", "--port", str(port), "--ray-address", ray_cluster, "--name", "specdec-sigterm",
             "--worker-cpus", "0.5", "--worker-host", "127.0.0.1", "--grace-period", "60", "--http-port", "-1",
             "--quiet"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        ready = _wait_line(lines, "specdec serving", 90, seen)
        assert f"127.0.0.1:{port}" in ready and "+draft" in ready
        assert "OpenAI-compatible HTTP API at http://127.0.0.1:" in ready

        n = MAX_POS - len(PROMPT) - 16  # long: ~1000 target-only rounds
        request = generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=n, ignore_eos=True,
                                                 num_speculative_tokens=0)
        target_pid = ray.get(ray.get_actor("specdec-sigterm-target", namespace="specdec").pid.remote(), timeout=30)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stream = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120)
        first = next(stream)  # the request is running
        tokens = list(first.token_ids)
        # It stays in flight while the drain is checked, however fast the machine: its target
        # worker (another process, no gate reaches it) is stopped until then; a round waits for it
        # (the round deadline is 30 s), and ~1000 rounds are far more than the moment before this.
        os.kill(target_pid, signal.SIGSTOP)
        try:
            proc.send_signal(signal.SIGTERM)
            _wait_line(lines, "draining", 30, seen)
            # Draining: new requests are refused (UNAVAILABLE) while the first one is still streaming.
            # The "draining" line is printed just before the coordinator is told; health says
            # NOT_SERVING once it drains (a request sent before could be let in, and wait on the
            # stopped worker).
            assert wait_until(lambda: health_status(port) == health_pb2.HealthCheckResponse.NOT_SERVING)
            with grpc.insecure_channel(f"127.0.0.1:{port}") as other:
                with pytest.raises(grpc.RpcError) as refused:
                    list(generation_pb2_grpc.GenerationStub(other).Generate(
                        generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=2), timeout=30))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            os.kill(target_pid, signal.SIGCONT)

        last = first
        for response in stream:
            tokens.extend(response.token_ids)
            last = response
        channel.close()
        assert last.finish_reason == "length"
        assert len(tokens) == n

        assert proc.wait(timeout=60) == 0
        _wait_line(lines, "stopped", 5, seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Its actors are gone with it (non-detached), the module's deployment is untouched.
    with pytest.raises(ValueError):
        ray.get_actor("specdec-sigterm-coordinator", namespace="specdec")
    assert generate(deployment.port, 3)[1].finish_reason == "length"


def test_a_worker_port_taken_before_it_binds_starts_again_on_new_ports(monkeypatch):
    """Loopback workers get a free port chosen before their models load; another process can take
    it meanwhile. Start-up then tries again on new ports (a few times), and does not retry any
    other failure, nor a fixed port's."""
    from specdec_app import ray_actors

    calls = []

    def once(config, **settings):
        calls.append(config)
        if len(calls) < 3:
            raise RuntimeError("target worker could not bind 127.0.0.1:33869: Failed to bind")
        return "deployment"

    monkeypatch.setattr(ray_actors, "_launch_once", once)
    assert ray_actors.launch(ServiceConfig.from_settings()) == "deployment" and len(calls) == 3

    calls.clear()
    with pytest.raises(RuntimeError, match="could not bind"):
        ray_actors.launch(ServiceConfig.from_settings(worker_host="10.0.0.5"))  # a fixed port
    assert len(calls) == 1

    def broken(config, **settings):
        calls.append(config)
        raise RuntimeError("the target's checkpoint is missing")

    calls.clear()
    monkeypatch.setattr(ray_actors, "_launch_once", broken)
    with pytest.raises(RuntimeError, match="missing"):
        ray_actors.launch(ServiceConfig.from_settings())
    assert len(calls) == 1


def test_near_tie_prompts_served_concurrently_on_ray_actors_give_the_target_alones_tokens(ray_cluster):
    """The Ray path of tests/test_near_ties.py: the shipped pair on its own actors, the near-tie
    prompts sent at once with K from 0 to 5 (one stream each, arriving while the others decode)."""
    from specdec_app.ray_actors import launch

    prompts, want = scan_near_ties()
    dep = launch(ServiceConfig.from_settings(target=str(SHIPPED_TARGET), draft=str(SHIPPED_DRAFT), adaptive=False,
                                             num_speculative_tokens=5, host="127.0.0.1", port=0, http_port=0,
                                             name="specdec-near-ties", worker_cpus=0.5, kv_cache_blocks=256))
    try:
        def serve(i: int) -> list[int]:
            request = generation_pb2.GenerateRequest(prompt_token_ids=prompts[i], max_new_tokens=NEW_TOKENS,
                                                     ignore_eos=True, num_speculative_tokens=i % 6)
            with grpc.insecure_channel(f"127.0.0.1:{dep.port}") as channel:
                stream = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120)
                return [t for response in stream for t in response.token_ids]

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(serve, range(len(prompts))))
    finally:
        dep.drain_and_stop(grace_s=2)
    assert got == want
