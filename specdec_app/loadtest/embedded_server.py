"""`specdec loadtest --embedded`: a server of the load test's own on 127.0.0.1, so that after the
run every KV block can be checked free and the engine empty; with --grpc-workers its workers are
served over loopback gRPC and every round's bytes on the wire are recorded (`WireRecorder`).
"""
from __future__ import annotations

import dataclasses
import time

from coordinator.frontend.server_thread import LOOPBACK_SERVER, run_server_in_thread
from coordinator.telemetry.metrics import WireDeltas
from draft_worker import grpc_server as draft_server
from draft_worker.worker import DraftWorker
from specdec.config import ServiceConfig
from specdec.model.source import resolve_model_source
from specdec_app.embedded import GrpcSchedulerFactory, LocalSchedulerFactory
from specdec_app.loadtest.records import LoadConfig, LoadReport, percentile
from specdec_app.loadtest.streams import run_load
from target_worker import grpc_server as target_server
from target_worker.worker import TargetWorker


class WireRecorder:
    """The server's on_round hook: bytes on the wire of every round, per worker (gRPC clients)."""

    def __init__(self, counters: dict):
        self._deltas = WireDeltas(counters)
        self._counters = counters
        self.rounds: list[dict] = []  # {"draft": sent+received, "target": ..., "sent", "received", "tokens"}

    def __call__(self, report) -> None:
        if not report.ran:
            return  # no round ran (nothing due); its bytes, if any, count towards the next round
        row = {"tokens": report.committed_tokens, "sent": 0, "received": 0}
        for worker, (sent, received) in self._deltas.take().items():
            row[worker] = sent + received
            row["sent"] += sent
            row["received"] += received
        self.rounds.append(row)

    def summary(self) -> dict | None:
        if not self.rounds:
            return None
        rows = self.rounds
        tokens = sum(r["tokens"] for r in rows)

        def stats(key):
            values = [float(r.get(key, 0)) for r in rows]
            return {"mean": sum(values) / len(values), "p99": percentile(values, 99), "total": int(sum(values))}

        per_round = [float(r["sent"] + r["received"]) for r in rows]
        total = sum(per_round)
        return {
            "rounds": len(rows),
            "generated_tokens": tokens,
            "bytes_per_round": {"mean": total / len(rows), "p99": percentile(per_round, 99), "total": int(total)},
            "sent_per_round": stats("sent"),
            "received_per_round": stats("received"),
            "draft_per_round": stats("draft"),
            "target_per_round": stats("target"),
            "bytes_per_token": total / tokens if tokens else None,
            "rpcs_per_worker": {worker: counter.rounds for worker, counter in self._counters.items()},
        }


def _caches(workers) -> dict:
    """The KV caches to audit: the target's, and the draft model's if there is one."""
    target_worker, draft_worker = workers
    caches = {"target": target_worker.cache}
    if draft_worker is not None and draft_worker.drafter.kv_cache is not None:
        caches["draft"] = draft_worker.drafter.kv_cache
    return caches


def run_embedded(config: ServiceConfig, load: LoadConfig, grpc_workers: bool = False,
                 settle_s: float = 10.0) -> LoadReport:
    """Start a server on 127.0.0.1:0 with in-process workers, run the load, then check that every
    KV block is free and the engine holds no request. `grpc_workers`: serve the workers over
    loopback gRPC and report bytes on the wire per round."""
    config = dataclasses.replace(config, server=dataclasses.replace(LOOPBACK_SERVER, grace_period=1.0))
    servers: list = []
    recorder = None
    if grpc_workers:
        workers = (TargetWorker.from_config(config.target), DraftWorker.from_config(config.draft))
        tserver, tport = target_server.serve(workers[0])
        servers.append(tserver)
        draft_address = None
        if workers[1] is not None:
            dserver, dport = draft_server.serve(workers[1])
            servers.append(dserver)
            draft_address = f"127.0.0.1:{dport}"
        factory = GrpcSchedulerFactory(config, f"127.0.0.1:{tport}", draft_address)
        recorder = WireRecorder(factory.wire)
    else:
        factory = LocalSchedulerFactory(config)
    if factory.tokenizer is None and not load.vocab_size:
        load.vocab_size = int(resolve_model_source(config.target.model).config["vocab_size"])
    try:
        with run_server_in_thread(factory, factory.tokenizer, config.server, on_round=recorder) as handle:
            if not grpc_workers:
                workers = (factory.target_worker, factory.draft_worker)
            report = run_load(f"127.0.0.1:{handle.port}", load)
            _settle(handle, workers, report, settle_s)
        _audit(workers, report)  # the scheduler thread has stopped: no race with it
    finally:
        factory.close()
        for server in servers:
            server.stop(None)
    if recorder is not None:
        report.wire = recorder.summary()
    return report


def _settle(handle, workers, report: LoadReport, settle_s: float) -> None:
    """Wait for the releases to reach the workers (on the scheduler's next pass)."""
    thread = handle.server.scheduler
    end = time.monotonic() + settle_s
    while time.monotonic() < end:
        sched = thread.scheduler
        idle = thread.num_active == 0 and not sched.running and not sched.waiting \
            and handle.server.gate.in_flight == 0
        if idle and not any(c.allocator.num_used for c in _caches(workers).values()):
            break
        time.sleep(0.01)
    sched = thread.scheduler
    if thread.num_active or sched.running or sched.waiting:
        report.failures.append(f"the engine still holds requests after the run: {thread.num_active} streams, "
                               f"{len(sched.running)} running, {len(sched.waiting)} waiting")


def _audit(workers, report: LoadReport) -> None:
    caches = _caches(workers)
    for name, cache in caches.items():
        try:
            cache.check_accounting()
        except Exception as e:  # noqa: BLE001 - reported as a failed check
            report.failures.append(f"{name} KV-cache accounting: {e}")
        if cache.allocator.num_used:
            report.failures.append(f"{cache.allocator.num_used} {name} KV blocks still in use after every "
                                   "stream ended")
    report.kv_blocks_used_target = caches["target"].allocator.num_used
    report.kv_blocks_used_draft = caches["draft"].allocator.num_used if "draft" in caches else None

