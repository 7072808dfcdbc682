"""One request's life as the public servers see it: submit it to the SchedulerThread, iterate its
updates, and drop it from the scheduler if the consumer stops early.

Both front doors (the gRPC servicer and the HTTP API) use `stream_request`, so they abort, time and
count requests the same way. Iterate it inside `contextlib.aclosing` so that a consumer that goes
away (client disconnect, cancelled RPC) aborts the request at once and its KV blocks are freed on
the next round; the cleanup never awaits, so it also completes inside a cancelled task.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from coordinator.frontend.request_gate import WaitingSlot
from coordinator.replicas.scheduler_thread import SchedulerThread, Sink
from coordinator.rounds.request import Request
from coordinator.rounds.round_report import RequestUpdate
from coordinator.telemetry.prometheus_metrics import PrometheusMetrics


class RequestFailed(Exception):
    """A request that ended without finishing. `kind`: "invalid" (the scheduler refused it: context
    length, vocabulary, KV blocks), "unavailable" (a worker is gone, the server is stopping),
    "deadline" or "internal"."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


async def stream_request(scheduler: SchedulerThread, request: Request, metrics: PrometheusMetrics | None = None,
                         waiting: WaitingSlot | None = None) -> AsyncIterator[RequestUpdate]:
    """Yield the request's updates (the last one has `finished` set); raise RequestFailed instead
    of yielding an update that reports a failure. `waiting`: the request's slot at the gate, given
    back with its first update (it has started) or when it ends."""
    updates: asyncio.Queue = asyncio.Queue()
    timer = metrics.time_request(len(request.prompt_ids)) if metrics is not None else None
    outcome = None  # how the request ended; None: the consumer stopped early
    scheduler.submit(request, Sink(asyncio.get_running_loop(), updates))
    try:
        while True:
            item = await updates.get()
            if waiting is not None:
                waiting.release()
            if isinstance(item, ValueError):
                outcome = "rejected"
                raise RequestFailed("invalid", str(item))
            if item.error_kind or (item.finished and item.error):
                outcome = item.finish_reason or "error"
                raise RequestFailed(item.error_kind or "internal", item.error or "request failed")
            if item.token_ids and timer is not None:
                timer.tokens(len(item.token_ids))
            if item.finished:
                outcome = item.finish_reason or "unknown"
            yield item
            if item.finished:
                return
    finally:
        if waiting is not None:
            waiting.release()
        if outcome is None:  # client gone, deadline, server stop: free its blocks now
            scheduler.abort(request.req_id)
        if timer is not None:
            timer.finish(outcome or "cancelled")
