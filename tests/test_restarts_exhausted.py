"""Ray has no restarts left for a worker: its requests fail at once with a clear UNAVAILABLE, and
health says NOT_SERVING (a Kubernetes readiness probe then takes the pod out of the Service).

A deployment of its own (max_restarts=0, a recovery timeout far longer than the test), so the
failure must come from Ray saying the actor is dead, not from waiting the timeout out.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest

ray = pytest.importorskip("ray")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from coordinator.frontend.server import SERVICE_NAME  # noqa: E402
from specdec import ServiceConfig  # noqa: E402
from specdec.client import GenerationClient  # noqa: E402

from checkpoints import CONFIGS, build_checkpoint  # noqa: E402
from gates import wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECOVERY_S = 300.0  # never reached here


def health_status(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


@pytest.mark.timeout(240)
def test_target_out_of_restarts_fails_its_streams_now_and_health_says_not_serving(tmp_path):
    from specdec_app.ray_actors import launch

    target = build_checkpoint(tmp_path / "target", seed=0, max_position_embeddings=1024, **CONFIGS["gqa_untied"])
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", namespace="specdec-exhausted",
             runtime_env={"env_vars": env})
    try:
        deployment = launch(ServiceConfig.from_settings(
            target=str(target), draft=None, host="127.0.0.1", port=0, http_port=0, name="specdec-exhausted",
            worker_cpus=0.5, max_restarts=0, worker_recovery_timeout=RECOVERY_S))
        try:
            assert health_status(deployment.port) == health_pb2.HealthCheckResponse.SERVING
            client = GenerationClient(f"127.0.0.1:{deployment.port}")
            target_pid = ray.get(deployment.target.pid.remote(), timeout=30)
            # The stream must still run at the kill. Its worker is in another process (no gate
            # reaches it): 900 target-only rounds of a gRPC round trip each (~0.6 s here, ~60 ms on
            # a machine 10x faster), against the microseconds from its first response to the kill.
            stream = client.generate_stream([3, 17, 42, 5], max_new_tokens=900, ignore_eos=True, timeout=120)
            next(stream)
            os.kill(target_pid, 9)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as failed:
                list(stream)
            waited = time.monotonic() - t0
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
            assert "will not be restarted" in failed.value.details() and "max_restarts" in failed.value.details()
            # 30 s: a tenth of the 300 s recovery timeout, room for a slow machine's Ray.
            assert waited < 30, f"failed after {waited:.0f}s: Ray's answer should end it, not the timeout"

            assert wait_until(lambda: health_status(deployment.port) == health_pb2.HealthCheckResponse.NOT_SERVING), \
                "health still SERVING with the target gone for good"
            with pytest.raises(grpc.RpcError) as refused:
                client.generate([5, 6], max_new_tokens=4)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "will not be restarted" in refused.value.details()
            snapshot = ray.get(deployment.coordinator.metrics_snapshot.remote(), timeout=10)
            assert "target" in snapshot["workers_down"], snapshot["workers_down"]
            client.close()
        finally:
            deployment.drain_and_stop(grace_s=1, timeout_s=15)
    finally:
        ray.shutdown()
