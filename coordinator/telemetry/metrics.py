"""Service metrics on the Ray dashboard (ray.util.metrics -> Prometheus -> Grafana panels).

`RoundMetrics` is the `on_round(report)` hook the public server's SchedulerThread calls with each
step's RoundReport. It records:

- acceptance: draft tokens proposed / accepted (counters) and a windowed acceptance-rate gauge
- throughput: generated tokens (counter) and a windowed tokens/s gauge
- round latency by phase (histogram, tag `phase`): `draft` and `verify` as the coordinator sees
  them (client side: worker compute + network + (de)serialization), `coordinator` = round time
  minus the two worker calls (scheduling, stop strings, streaming), and `total`
- queue depth, running requests, KV blocks used / total / usage fraction (gauges, tag `replica`:
  one series per target replica; `snapshot()` sums them and keeps each under "replicas")
- finished requests by reason (counter, tag `reason`) and per-request acceptance (histogram)
- resumed requests by worker (counter: carried on after a lost worker came back) and whether each
  worker answers (gauge `specdec_worker_up`, tag `worker`)
- overlapped drafting: pre-drafted tokens and those kept (counters; snapshot: the kept fraction)
- bytes on the wire to and from the workers, when given the gRPC clients' WireCounters (in-process
  workers have none): per round (histogram and last-round gauges, tags `direction` = sent |
  received and `worker` = draft | target | all) and cumulative (counter)

Without Ray (embedded server, unit tests) nothing is exported and the callback only keeps the
cheap in-process totals of `snapshot()`. It never imports Ray itself and never raises into the
round loop. Ray prefixes exported names with `ray_`, e.g. `ray_specdec_generated_tokens_total`.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque

from coordinator.rounds.grpc_clients import WireCounter
from coordinator.rounds.round_report import RoundReport

log = logging.getLogger(__name__)

LATENCY_BOUNDARIES_S = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]
RATE_BOUNDARIES = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]
WIRE_BYTES_BOUNDARIES = [64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216]


class WireDeltas:
    """Bytes sent / received per worker since the previous call, from cumulative WireCounters
    (coordinator.rounds.grpc_clients): deltas of cumulative counts stay exact when a worker sat a round
    out."""

    def __init__(self, counters: dict[str, WireCounter]):
        self.counters = counters  # worker ("draft" | "target") -> its client's counter
        self._last = {worker: (0, 0) for worker in counters}

    def take(self) -> dict[str, tuple[int, int]]:
        out = {}
        for worker, counter in self.counters.items():
            prev_sent, prev_received = self._last[worker]
            self._last[worker] = (counter.bytes_sent, counter.bytes_received)
            out[worker] = (counter.bytes_sent - prev_sent, counter.bytes_received - prev_received)
        return out


def ray_is_initialized() -> bool:
    """True when this process is connected to Ray (without importing Ray if nothing has)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


class _RayInstruments:
    """The ray.util.metrics objects; created once per process (the names are global)."""

    def __init__(self, deployment: str):
        from ray.util import metrics as m  # only where Ray runs: the coordinator never imports Ray itself

        tags = {"deployment": deployment}

        def counter(name, desc, keys=()):
            return m.Counter(name, desc, tag_keys=("deployment", *keys)).set_default_tags(tags)

        def gauge(name, desc, keys=()):
            return m.Gauge(name, desc, tag_keys=("deployment", *keys)).set_default_tags(tags)

        def histogram(name, desc, bounds, keys=()):
            return m.Histogram(name, desc, boundaries=bounds, tag_keys=("deployment", *keys)).set_default_tags(tags)

        self.generated = counter("specdec_generated_tokens", "Tokens committed to requests")
        self.proposed = counter("specdec_draft_tokens_proposed", "Draft tokens sent to the target for verification")
        self.accepted = counter("specdec_draft_tokens_accepted", "Draft tokens the target accepted")
        self.rounds = counter("specdec_rounds", "Speculation rounds (one target forward pass each)")
        self.predraft_tokens = counter("specdec_predraft_tokens", "Tokens asked of pre-drafts (overlapped drafting)")
        self.predraft_kept = counter("specdec_predraft_kept", "Pre-drafted tokens used: confirmed bonus guesses "
                                     "and proposals")
        self.finished = counter("specdec_requests_finished", "Finished requests by finish reason", ("reason",))
        self.resumed = counter("specdec_requests_resumed", "Requests carried on after a lost worker came back, "
                               "by worker", ("worker",))
        self.worker_up = gauge("specdec_worker_up", "1 while the worker answers, 0 while it is lost",
                               ("worker", "replica"))
        self.tokens_per_s = gauge("specdec_tokens_per_second", "Generated tokens per second (sliding window)")
        self.acceptance = gauge("specdec_acceptance_rate", "Accepted / proposed draft tokens (sliding window)")
        replica = ("replica",)
        self.queue_depth = gauge("specdec_queue_depth", "Requests waiting for admission", replica)
        self.running = gauge("specdec_running_requests", "Requests in the running batch", replica)
        self.kv_used = gauge("specdec_kv_blocks_used", "Target KV-cache blocks in use", replica)
        self.kv_total = gauge("specdec_kv_blocks_total", "Target KV-cache blocks in total", replica)
        self.kv_usage = gauge("specdec_kv_cache_usage", "Fraction of target KV-cache blocks in use", replica)
        self.round_seconds = histogram("specdec_round_seconds", "Round latency by phase (draft, verify, "
                                       "coordinator, total)", LATENCY_BOUNDARIES_S, ("phase",))
        self.request_acceptance = histogram("specdec_request_acceptance_rate",
                                            "Acceptance rate of each finished request", RATE_BOUNDARIES)
        wire_keys = ("deployment", "direction", "worker")
        self.wire_bytes = m.Counter("specdec_wire_bytes", "Worker payload bytes on the wire (protobuf), by "
                                    "direction (sent/received) and worker (draft/target)",
                                    tag_keys=wire_keys).set_default_tags(tags)
        self.wire_bytes_last_round = m.Gauge("specdec_wire_bytes_last_round", "Worker payload bytes of the last "
                                             "round, by direction and worker (all = both workers)",
                                             tag_keys=wire_keys).set_default_tags(tags)
        self.wire_bytes_per_round = histogram("specdec_wire_bytes_per_round", "Worker payload bytes per round, by "
                                              "direction and worker (all = both workers)", WIRE_BYTES_BOUNDARIES,
                                              ("direction", "worker"))


_INSTRUMENTS: dict[str, _RayInstruments] = {}
_INSTRUMENTS_LOCK = threading.Lock()


def _instruments(deployment: str) -> _RayInstruments:
    with _INSTRUMENTS_LOCK:
        if deployment not in _INSTRUMENTS:
            _INSTRUMENTS[deployment] = _RayInstruments(deployment)
        return _INSTRUMENTS[deployment]


class _Window:
    """Sums of (numerator, denominator) over the last `seconds`, for rate gauges."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._points: deque[tuple[float, float, float]] = deque()
        self._start = time.monotonic()

    def add(self, now: float, a: float, b: float = 0.0) -> None:
        self._points.append((now, a, b))

    def sums(self, now: float) -> tuple[float, float, float]:
        """(sum a, sum b, seconds covered) over the window ending now."""
        while self._points and self._points[0][0] < now - self.seconds:
            self._points.popleft()
        a = sum(p[1] for p in self._points)
        b = sum(p[2] for p in self._points)
        return a, b, max(min(self.seconds, now - self._start), 1e-9)


class RoundMetrics:
    """The on_round hook: call it with each RoundReport. `wire`: the gRPC clients' counters."""

    def __init__(self, deployment: str = "specdec", wire: dict[str, WireCounter] | None = None,
                 window_s: float = 10.0, refresh_s: float = 2.0, export: bool | None = None):
        self.deployment = deployment
        self._lock = threading.Lock()
        self._tokens = _Window(window_s)
        self._accept = _Window(window_s)
        self._failed_once = False
        self.totals = {"generated_tokens": 0, "proposed": 0, "accepted": 0, "rounds": 0, "finished": {},
                       "round_seconds": {}, "queue_depth": 0, "running": 0, "kv_blocks_used": 0,
                       "kv_blocks_total": 0, "wire_bytes": {}, "wire_bytes_last_round": {}, "resumed": {},
                       "workers_down": [], "replicas": {}, "predraft_tokens": 0, "predraft_kept": 0}
        self._wire = WireDeltas(wire) if wire else None
        self._wire_pending: dict[str, tuple[int, int]] = {}
        export = ray_is_initialized() if export is None else export
        self._ray = _instruments(deployment) if export else None
        self._stop = threading.Event()
        if self._ray is not None and refresh_s > 0:
            # Rates decay to 0 while idle only if someone sets them: the loop does not call us then.
            threading.Thread(target=self._refresh_loop, args=(refresh_s,), name="specdec-metrics",
                             daemon=True).start()

    @property
    def exporting(self) -> bool:
        return self._ray is not None

    def close(self) -> None:
        self._stop.set()

    def __call__(self, report: RoundReport) -> None:
        try:
            self._on_round(report)
        except Exception:  # noqa: BLE001 - metrics must never break serving
            if not self._failed_once:
                self._failed_once = True
                log.exception("recording round metrics failed (logged once)")

    def _on_round(self, report: RoundReport) -> None:
        now = time.monotonic()
        generated, proposed, accepted = report.committed_tokens, report.proposed_tokens, report.accepted_tokens
        finished = [(u.finish_reason or "unknown", u.stats.acceptance_rate if u.stats is not None else None)
                    for u in report.finished]
        phases = report.phase_seconds
        # Bytes of steps without a round (releases only) count in the totals at once and in the
        # per-round figures of the next round.
        wire = self._wire.take() if self._wire is not None else {}
        round_wire = {}
        for worker, (sent, received) in wire.items():
            p_sent, p_received = self._wire_pending.get(worker, (0, 0))
            self._wire_pending[worker] = (p_sent + sent, p_received + received)
        if report.ran and self._wire_pending:
            round_wire, self._wire_pending = self._wire_pending, {}
            round_wire["all"] = (sum(v[0] for v in round_wire.values()), sum(v[1] for v in round_wire.values()))

        with self._lock:
            t = self.totals
            t["generated_tokens"] += generated
            t["proposed"] += proposed
            t["accepted"] += accepted
            t["rounds"] += int(report.ran)
            t["predraft_tokens"] += report.predraft_tokens
            t["predraft_kept"] += report.predraft_kept
            for reason, _ in finished:
                t["finished"][reason] = t["finished"].get(reason, 0) + 1
            t["round_seconds"].update(phases)
            replica = t["replicas"].setdefault(report.replica, {"rounds": 0})
            replica.update(queue_depth=report.queue_depth, running=report.running,
                           kv_blocks_used=report.kv_blocks_used, kv_blocks_total=report.kv_blocks_total,
                           workers_down=list(report.workers_down), rounds=replica["rounds"] + int(report.ran))
            for key in ("queue_depth", "running", "kv_blocks_used", "kv_blocks_total"):
                t[key] = sum(r[key] for r in t["replicas"].values())
            for worker, req_ids in report.resumed.items():
                t["resumed"][worker] = t["resumed"].get(worker, 0) + len(req_ids)
            t["workers_down"] = sorted({w for r in t["replicas"].values() for w in r["workers_down"]})
            for worker, (sent, received) in wire.items():
                total = t["wire_bytes"].setdefault(worker, {"sent": 0, "received": 0})
                total["sent"] += sent
                total["received"] += received
            for worker, (sent, received) in round_wire.items():
                t["wire_bytes_last_round"][worker] = {"sent": sent, "received": received}
            self._tokens.add(now, generated)
            self._accept.add(now, accepted, proposed)
        if self._ray is not None:
            self._export(report, generated, proposed, accepted, finished, phases, wire, round_wire, now)

    def _export(self, report, generated, proposed, accepted, finished, phases, wire, round_wire, now) -> None:
        r = self._ray
        if generated:
            r.generated.inc(generated)
        if proposed:
            r.proposed.inc(proposed)
        if accepted:
            r.accepted.inc(accepted)
        if report.ran:
            r.rounds.inc(1)
        if report.predraft_tokens:
            r.predraft_tokens.inc(report.predraft_tokens)
        if report.predraft_kept:
            r.predraft_kept.inc(report.predraft_kept)
        for reason, rate in finished:
            r.finished.inc(1, tags={"reason": reason})
            if rate is not None:
                r.request_acceptance.observe(rate)
        for phase, seconds in phases.items():
            r.round_seconds.observe(seconds, tags={"phase": phase})
        for worker, values in wire.items():
            for direction, n in zip(("sent", "received"), values):
                if n:
                    r.wire_bytes.inc(n, tags={"direction": direction, "worker": worker})
        for worker, values in round_wire.items():
            for direction, n in zip(("sent", "received"), values):
                tags = {"direction": direction, "worker": worker}
                r.wire_bytes_last_round.set(n, tags=tags)
                r.wire_bytes_per_round.observe(n, tags=tags)
        for worker, req_ids in report.resumed.items():
            r.resumed.inc(len(req_ids), tags={"worker": worker})
        replica = {"replica": str(report.replica)}
        for worker in ("target", "draft"):
            r.worker_up.set(0.0 if worker in report.workers_down else 1.0, tags={"worker": worker, **replica})
        r.queue_depth.set(report.queue_depth, tags=replica)
        r.running.set(report.running, tags=replica)
        r.kv_used.set(report.kv_blocks_used, tags=replica)
        r.kv_total.set(report.kv_blocks_total, tags=replica)
        if report.kv_blocks_total:
            r.kv_usage.set(report.kv_blocks_used / report.kv_blocks_total, tags=replica)
        self._set_rates(now)

    def _set_rates(self, now: float) -> None:
        with self._lock:
            tokens, _, span = self._tokens.sums(now)
            accepted, proposed, _ = self._accept.sums(now)
        self._ray.tokens_per_s.set(tokens / span)
        if proposed:
            self._ray.acceptance.set(accepted / proposed)

    def _refresh_loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                self._set_rates(time.monotonic())
            except Exception:  # noqa: BLE001
                return

    def snapshot(self) -> dict:
        """In-process totals (also without Ray): counters, last round's phases, gauges, rates."""
        now = time.monotonic()
        with self._lock:
            snap = {k: ({kk: (dict(vv) if isinstance(vv, dict) else vv) for kk, vv in v.items()}
                        if isinstance(v, dict) else v) for k, v in self.totals.items()}
            tokens, _, span = self._tokens.sums(now)
            accepted, proposed, _ = self._accept.sums(now)
        snap["tokens_per_second"] = tokens / span
        snap["acceptance_rate"] = (snap["accepted"] / snap["proposed"]) if snap["proposed"] else None
        snap["window_acceptance_rate"] = accepted / proposed if proposed else None
        snap["predraft_kept_fraction"] = (snap["predraft_kept"] / snap["predraft_tokens"]
                                          if snap["predraft_tokens"] else None)
        snap["exporting"] = self.exporting
        return snap
