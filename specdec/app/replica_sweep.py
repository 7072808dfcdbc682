"""`specdec loadtest --replicas-sweep 1,2`: the same load against 1, 2, ... target replicas.

For each count a local Ray instance runs the service with that many replicas (each target worker
its own process; give each one thread with --target-threads 1 so they really run side by side),
the load runs against it, and the deployment stops. The table puts the throughput ratio to the
first count beside time to first token and inter-token latency (p50 / p99), measured in one run.
"""
from __future__ import annotations

import os
from pathlib import Path

from specdec.app.loadtest import LoadConfig, LoadReport, run_streams
from specdec.config import REPO_ROOT, ServiceConfig


def _absolute_models(config: ServiceConfig) -> dict:
    """Actors run in other directories: model paths must not be relative to this one."""
    return {role: str(Path(model).resolve()) for role, model in (("target", config.target.model),
                                                                 ("draft", config.draft.model))
            if model is not None and Path(model).exists()}


def run_replica_sweep(config: ServiceConfig, load: LoadConfig, counts: list[int]) -> list[tuple[int, LoadReport]]:
    import ray

    from specdec.app.ray_actors import launch

    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    results = []
    for count in counts:
        run_config = ServiceConfig.from_settings(config, host="127.0.0.1", port=0, http_port=0, replicas=count,
                                                 name=f"specdec-sweep-{count}", **_absolute_models(config))
        ray.init(include_dashboard=False, logging_level="WARNING", namespace="specdec",
                 num_cpus=max(os.cpu_count() or 1, count), runtime_env={"env_vars": env})
        try:
            deployment = launch(run_config)
            try:
                report, _ = run_streams(f"127.0.0.1:{deployment.port}", load)
            finally:
                deployment.drain_and_stop(5.0)
        finally:
            ray.shutdown()
        results.append((count, report))
    return results


def format_sweep(results: list[tuple[int, LoadReport]]) -> str:
    base = results[0][1].throughput_tokens_per_s or float("nan")
    lines = ["replicas  tokens/s  ratio  TTFT p50 / p99 ms   ITL/token p50 / p99 ms  completed / failed",
             "--------  --------  -----  -----------------   ----------------------  ------------------"]
    for count, r in results:
        lines.append(f"{count:>8}  {r.throughput_tokens_per_s:>8.1f}  {r.throughput_tokens_per_s / base:>5.2f}  "
                     f"{r.ttft_p50_ms or 0:>7.0f} / {r.ttft_p99_ms or 0:<7.0f}   "
                     f"{r.itl_token_p50_ms or 0:>8.1f} / {r.itl_token_p99_ms or 0:<8.1f}     "
                     f"{r.completed} / {r.failed}")
    return "\n".join(lines)
