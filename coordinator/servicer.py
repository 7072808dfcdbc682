"""specdec.v1.Generation/Generate: one server-streaming call per request.

Every round that commits tokens becomes one GenerateResponse; the last one carries finish_reason
and stats. Status codes: bytes that are not a GenerateRequest (coordinator.request_decoding) or a
ValueError from validation -> INVALID_ARGUMENT (with its message); more requests waiting than
--max-waiting-requests -> RESOURCE_EXHAUSTED; a worker that is gone -> UNAVAILABLE; a deadline ->
DEADLINE_EXCEEDED; anything else that broke a round -> INTERNAL. Cheap checks come first (stop
strings, prompt length in token ids); the prompt is tokenized on the tokenizer thread
(coordinator.tokenizer_pool), bounded by the context length. A client that goes away aborts its
request at once, so its KV blocks are freed on the next round.
"""
from __future__ import annotations

import contextlib
import itertools
import uuid

import grpc

from coordinator.prometheus_metrics import PrometheusMetrics
from coordinator.request import RequestStats
from coordinator.request_decoding import MalformedRequest
from coordinator.request_gate import QueueFull, RequestGate
from coordinator.request_limits import RequestLimits
from coordinator.request_stream import RequestFailed, stream_request
from coordinator.scheduler_thread import SchedulerThread
from coordinator.tokenizer_pool import TokenizerPool
from coordinator.validation import new_request, prompt_from_proto
from specdec import wire
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
    """Register it with coordinator.request_decoding.add_generation_servicer."""

    def __init__(self, scheduler: SchedulerThread, tokenizers: TokenizerPool, limits: RequestLimits,
                 gate: RequestGate | None = None, metrics: PrometheusMetrics | None = None):
        self.scheduler = scheduler
        self.tokenizers = tokenizers
        self.limits = limits
        self.gate = gate or RequestGate()
        self.metrics = metrics
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]

    async def Generate(self, request, context):
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        if self.gate.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")
        if (failure := self.scheduler.failure) is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the service is unavailable: {failure}; retry later")
        try:
            waiting = self.gate.wait_slot()
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        try:
            try:
                self.limits.check_stops(request.stop)
                params, num_speculative_tokens = wire.params_from_generate_request(request)
                prompt, messages = prompt_from_proto(request, self.scheduler.max_seq_len)
                ids = await self.tokenizers.prompt_ids(prompt, messages, self.scheduler.max_seq_len)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            req = new_request(f"{self._prefix}-{next(self._ids)}", ids, params, num_speculative_tokens,
                              context.time_remaining())
            # The RPC ended, however it ended: drop the request if it still runs (aborting a
            # finished or unknown request is a no-op).
            context.add_done_callback(lambda _ctx: self.scheduler.abort(req.req_id))
            self.gate.enter()
            try:
                async with contextlib.aclosing(stream_request(self.scheduler, req, self.metrics,
                                                              waiting)) as updates:
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
        finally:
            waiting.release()  # if it has not started by now, it never will
