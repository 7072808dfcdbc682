"""The service's own Prometheus metrics, scraped at the HTTP API's GET /metrics.

One CollectorRegistry per server (never prometheus_client's global one), fed from two places:
- `on_round(report)`: the SchedulerThread calls it with every RoundReport (token and draft
  counters, round phases, queue, running requests, KV blocks), reading the same RoundReport
  properties as the Ray exporter (coordinator.telemetry.metrics), so both count alike;
- `time_request(...)`: coordinator.frontend.request_stream times every public request, gRPC and HTTP
  (time to first token, inter-token latency, duration, how it ended).

Gauges of ratios are computed at scrape time from the totals since the server started (NaN until
there is something to divide); for a windowed figure take rate() of the counters. The README lists
every name.
"""
from __future__ import annotations

import math
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from coordinator.rounds.round_report import RoundReport

# How a request can end: the scheduler's finish reasons, plus "cancelled" (the client went away)
# and "rejected" (the scheduler refused it: context length, vocabulary, KV blocks).
FINISH_REASONS = ("eos", "stop", "length", "deadline", "error", "cancelled", "rejected")
ROUND_PHASES = ("draft", "verify", "coordinator", "total")
ROUND_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _ratio(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else math.nan


class PrometheusMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("specdec_requests", "Requests that ended, by finish reason", ("finish_reason",),
                                registry=r)
        for reason in FINISH_REASONS:
            self.requests.labels(reason)  # export every reason from the start, at 0
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of the requests that ended", registry=r)
        self.generated = Counter("specdec_generated_tokens", "Tokens committed to requests", registry=r)
        self.proposed = Counter("specdec_draft_tokens_proposed", "Draft tokens proposed to the target", registry=r)
        self.accepted = Counter("specdec_draft_tokens_accepted", "Draft tokens the target accepted", registry=r)
        self.rounds = Counter("specdec_rounds", "Rounds that ran a target forward pass", registry=r)
        self.predraft_tokens = Counter("specdec_predraft_tokens", "Tokens asked of pre-drafts (overlapped "
                                       "drafting)", registry=r)
        self.predraft_kept = Counter("specdec_predraft_kept", "Pre-drafted tokens used: confirmed bonus guesses "
                                     "and proposals", registry=r)
        Gauge("specdec_acceptance_rate", "Accepted / proposed draft tokens since start (NaN: none proposed)",
              registry=r).set_function(lambda: _ratio(self._totals[1], self._totals[0]))
        Gauge("specdec_mean_accepted_length", "Tokens committed per target forward pass over a request, since "
              "start (1.0 without speculation)", registry=r).set_function(
            lambda: _ratio(self._totals[2], self._totals[3]))
        # Per target replica (coordinator.replicas.router): what the router balances.
        replica = ("replica",)
        self.queue_depth = Gauge("specdec_queue_depth", "Requests waiting for admission", replica, registry=r)
        self.running = Gauge("specdec_running_requests", "Requests in the running batch", replica, registry=r)
        self.kv_used = Gauge("specdec_kv_blocks_used", "Target KV-cache blocks in use", replica, registry=r)
        self.kv_total = Gauge("specdec_kv_blocks_total", "Target KV-cache blocks in total", replica, registry=r)
        self.round_seconds = Histogram("specdec_round_seconds", "Round latency by phase (draft, verify, "
                                       "coordinator, total)", ("phase",), buckets=ROUND_BUCKETS_S, registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "From a request's arrival to its first "
                              "streamed tokens", buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("specdec_inter_token_latency_seconds", "Time between a request's streamed chunks "
                             "divided by the chunk's tokens (once per token)", buckets=ITL_BUCKETS_S, registry=r)
        self.duration = Histogram("specdec_request_duration_seconds", "From a request's arrival to its end",
                                  buckets=DURATION_BUCKETS_S, registry=r)
        # proposed, accepted, generated, target passes over requests: read by the ratio gauges.
        self._totals = [0, 0, 0, 0]
        self._lock = threading.Lock()

    def on_round(self, report: RoundReport) -> None:
        """The SchedulerThread's hook (its thread); never raises into the round loop."""
        generated, proposed, accepted = report.committed_tokens, report.proposed_tokens, report.accepted_tokens
        with self._lock:
            totals = self._totals
            totals[0] += proposed
            totals[1] += accepted
            totals[2] += generated
            totals[3] += report.verified_requests
        self.generated.inc(generated)
        self.proposed.inc(proposed)
        self.accepted.inc(accepted)
        self.rounds.inc(int(report.ran))
        self.predraft_tokens.inc(report.predraft_tokens)
        self.predraft_kept.inc(report.predraft_kept)
        replica = str(report.replica)
        for phase, seconds in report.phase_seconds.items():
            self.round_seconds.labels(phase).observe(seconds)
        self.queue_depth.labels(replica).set(report.queue_depth)
        self.running.labels(replica).set(report.running)
        self.kv_used.labels(replica).set(report.kv_blocks_used)
        self.kv_total.labels(replica).set(report.kv_blocks_total)

    def time_request(self, prompt_tokens: int) -> RequestTimer:
        return RequestTimer(self, prompt_tokens)

    def render(self) -> bytes:
        """The text exposition format (CONTENT_TYPE)."""
        return generate_latest(self.registry)


class RequestTimer:
    """One request's latencies, from its arrival (construction) to its end (`finish`)."""

    def __init__(self, metrics: PrometheusMetrics, prompt_tokens: int):
        self.metrics = metrics
        self.prompt_tokens = prompt_tokens
        self.start = time.monotonic()
        self._last: float | None = None  # when the previous chunk of tokens arrived

    def tokens(self, n: int) -> None:
        """A chunk of n tokens arrived. A round commits several tokens at once, so the gap since
        the previous chunk is shared out over them: what a client sees per token."""
        now = time.monotonic()
        if self._last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            per_token = (now - self._last) / n
            for _ in range(n):
                self.metrics.itl.observe(per_token)
        self._last = now

    def finish(self, reason: str) -> None:
        m = self.metrics
        m.duration.observe(time.monotonic() - self.start)
        m.requests.labels(reason).inc()
        m.prompt_tokens.inc(self.prompt_tokens)
