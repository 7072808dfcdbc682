"""`specdec loadtest --replicas-sweep 1,2`: the same load against 1, 2, ... target replicas.

For each count a local Ray instance runs the service with that many replicas (each target worker
its own process; give each one thread with --target-threads 1 so they really run side by side),
the load runs against it, and the deployment stops. The table puts the throughput ratio to the
first count beside time to first token and inter-token latency (p50 / p99), measured in one run.
"""
from __future__ import annotations

from specdec.config import ServiceConfig
from specdec_app.loadtest.local_ray import local_config, local_deployment, machine_cpus
from specdec_app.loadtest.records import LoadConfig, LoadReport
from specdec_app.loadtest.streams import run_streams


def run_replica_sweep(config: ServiceConfig, load: LoadConfig, counts: list[int]) -> list[tuple[int, LoadReport]]:
    results = []
    for count in counts:
        run_config = local_config(config, f"specdec-sweep-{count}", replicas=count)
        with local_deployment(run_config, machine_cpus(count)) as deployment:
            report, _ = run_streams(f"127.0.0.1:{deployment.port}", load)
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
