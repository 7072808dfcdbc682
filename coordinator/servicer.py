"""specdec.v1.Generation/Generate: one server-streaming call per request.

Every round that commits tokens becomes one GenerateResponse; the last one carries finish_reason
and stats. Status codes: a ValueError from validation -> INVALID_ARGUMENT (with its message); a
worker that is gone -> UNAVAILABLE; a deadline -> DEADLINE_EXCEEDED; anything else that broke a
round -> INTERNAL. A client that goes away aborts its request at once, so its KV blocks are freed
on the next round.
"""
from __future__ import annotations

import contextlib
import itertools
import uuid

import grpc

from coordinator.prometheus_metrics import PrometheusMetrics
from coordinator.request import RequestStats
from coordinator.request_gate import RequestGate
from coordinator.request_stream import RequestFailed, stream_request
from coordinator.scheduler_thread import SchedulerThread
from coordinator.validation import request_from_proto
from specdec.v1 import generation_pb2, generation_pb2_grpc


def stats_to_proto(stats: RequestStats | None) -> generation_pb2.GenerationStats:
    msg = generation_pb2.GenerationStats()
    if stats is None:
        return msg
    if stats.acceptance_rate is not None:
        msg.acceptance_rate = stats.acceptance_rate
    msg.mean_accepted_length = stats.mean_accepted_length
    msg.rounds = stats.rounds
    msg.target_forward_passes = stats.target_forward_passes
    msg.draft_forward_passes = stats.draft_forward_passes
    msg.prompt_tokens = stats.prompt_tokens
    msg.generated_tokens = stats.generated
    return msg


_STATUS_OF_FAILURE = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "unavailable": grpc.StatusCode.UNAVAILABLE,
                      "deadline": grpc.StatusCode.DEADLINE_EXCEEDED}


def _error_status(failure: RequestFailed) -> tuple[grpc.StatusCode, str]:
    code = _STATUS_OF_FAILURE.get(failure.kind, grpc.StatusCode.INTERNAL)
    if code == grpc.StatusCode.UNAVAILABLE:
        return code, f"the service is unavailable: {failure.message}; retry later"
    if code == grpc.StatusCode.INTERNAL:
        return code, f"the request failed inside the service: {failure.message}"
    return code, failure.message


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, scheduler: SchedulerThread, tokenizer, gate: RequestGate | None = None,
                 metrics: PrometheusMetrics | None = None):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.gate = gate or RequestGate()
        self.metrics = metrics
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]

    async def Generate(self, request, context):
        if self.gate.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")
        if (failure := self.scheduler.failure) is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the service is unavailable: {failure}; retry later")
        try:
            req = request_from_proto(request, self.tokenizer, f"{self._prefix}-{next(self._ids)}",
                                     context.time_remaining())
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # The RPC ended, however it ended: drop the request if it still runs (aborting a finished
        # or unknown request is a no-op).
        context.add_done_callback(lambda _ctx: self.scheduler.abort(req.req_id))
        self.gate.enter()
        try:
            async with contextlib.aclosing(stream_request(self.scheduler, req, self.metrics)) as updates:
                async for update in updates:
                    response = generation_pb2.GenerateResponse(token_ids=update.token_ids, text=update.text)
                    if update.finished:
                        response.finish_reason = update.finish_reason or ""
                        response.stats.CopyFrom(stats_to_proto(update.stats))
                        yield response
                        return
                    if update.token_ids or update.text:
                        yield response
        except RequestFailed as failure:
            await context.abort(*_error_status(failure))
        finally:
            self.gate.leave()
