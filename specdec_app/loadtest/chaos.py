"""`specdec loadtest --chaos SECONDS`: load against a Ray deployment whose workers keep dying.

A local Ray instance runs the service (workers restarted by Ray without limit). While closed-loop
clients keep streams going (greedy and seeded sampled, alternating), a random worker process is
killed with SIGKILL every SECONDS. Afterwards every completed stream is replayed on an in-process
engine that nothing interrupts, and compared token for token. The report: streams completed /
cancelled / failed, requests resumed (by worker, from the coordinator's metrics), kills, and
streams whose output differs from the uninterrupted run. The goal is 0 failed, 0 different.
"""
from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import ray

from specdec.config import ServiceConfig
from specdec.params import SamplingParams
from specdec_app.engine import LocalEngine
from specdec_app.loadtest.local_ray import local_config, local_deployment, machine_cpus
from specdec_app.loadtest.records import LoadConfig, LoadReport
from specdec_app.loadtest.streams import run_streams
from specdec_app.ray_cluster import get_while_up


@dataclass
class ChaosReport:
    every_s: float
    kills: list[dict] = field(default_factory=list)  # {"at_s", "worker", "pid"}
    resumed: dict = field(default_factory=dict)  # worker -> requests resumed after it came back
    verified: int = 0  # completed streams replayed uninterrupted
    different: list[str] = field(default_factory=list)  # tags of streams whose tokens differ

    @property
    def ok(self) -> bool:
        return not self.different


def _killer(deployment, every_s: float, stop: threading.Event, report: ChaosReport, seed: int) -> None:
    rng = random.Random(seed)
    workers = {"target": deployment.target, "draft": deployment.draft}
    workers = {role: actor for role, actor in workers.items() if actor is not None}
    start = time.monotonic()
    while not stop.wait(every_s):
        role = rng.choice(sorted(workers))
        try:  # (in short waits: the killer stops with the load, not after a worker's restart)
            pid = get_while_up(workers[role].pid.remote(), max(every_s, 30.0), poll_s=0.2, stop=stop)
        except Exception:  # noqa: BLE001 - still restarting from the last kill: try the next tick
            continue
        if stop.is_set():
            break
        os.kill(pid, signal.SIGKILL)
        report.kills.append({"at_s": round(time.monotonic() - start, 1), "worker": role, "pid": pid})


def _replay(config: ServiceConfig, load: LoadConfig, records, chaos: ChaosReport) -> None:
    """Every completed stream again, on an in-process engine nothing interrupts."""
    done = [r for r in records if r.status == "completed"]
    engine = LocalEngine(config=dataclasses.replace(config, ray=dataclasses.replace(config.ray, enabled=False)))
    batch = config.scheduler.max_batch_size
    for i in range(0, len(done), batch):
        group = done[i:i + batch]
        params = [SamplingParams(max_new_tokens=load.max_new_tokens, temperature=r.temperature or 0.0, seed=r.seed,
                                 ignore_eos=True) for r in group]
        for rec, out in zip(group, engine.generate([r.prompt for r in group], params)):
            if out.token_ids != rec.token_ids:
                chaos.different.append(rec.tag)
    chaos.verified = len(done)


def run_chaos(config: ServiceConfig, load: LoadConfig, every_s: float) -> tuple[LoadReport, ChaosReport]:
    """Start a local Ray deployment of `config`, run `load` (in duration mode) against it while
    killing a worker every `every_s` seconds, stop everything, replay and compare."""
    config = local_config(config, "specdec-chaos", max_restarts=-1)
    chaos = ChaosReport(every_s=every_s)
    with local_deployment(config, machine_cpus(2)) as deployment:
        stop = threading.Event()
        killer = threading.Thread(target=_killer, args=(deployment, every_s, stop, chaos, load.seed), daemon=True)
        killer.start()
        try:
            report, records = run_streams(f"127.0.0.1:{deployment.port}", load)
        finally:
            stop.set()
            killer.join(60)
        chaos.resumed = ray.get(deployment.coordinator.metrics_snapshot.remote(), timeout=30).get("resumed", {})
    _replay(config, load, records, chaos)
    if chaos.different:
        report.failures.append(f"{len(chaos.different)} streams differ from an uninterrupted run: "
                               f"{', '.join(chaos.different[:10])}")
    return report, chaos


def format_chaos(chaos: ChaosReport) -> str:
    by_worker = {}
    for kill in chaos.kills:
        by_worker[kill["worker"]] = by_worker.get(kill["worker"], 0) + 1
    rows = [
        (f"workers killed (every {chaos.every_s:g}s)",
         ", ".join(f"{worker} {n}" for worker, n in sorted(by_worker.items())) or "none"),
        ("requests resumed", ", ".join(f"after {worker} {n}" for worker, n in sorted(chaos.resumed.items())) or "0"),
        ("completed streams replayed uninterrupted", str(chaos.verified)),
        ("streams with different output", str(len(chaos.different))),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
