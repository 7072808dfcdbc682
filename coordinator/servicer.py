"""specdec.v1.Generation/Generate: one server-streaming call per request.

Every round that commits tokens becomes one GenerateResponse; the last one carries finish_reason
and stats. Status codes: a ValueError from validation -> INVALID_ARGUMENT (with its message); a
worker that is gone -> UNAVAILABLE; a deadline -> DEADLINE_EXCEEDED; anything else that broke a
round -> INTERNAL. A client that goes away aborts its request at once, so its KV blocks are freed
on the next round.
"""
from __future__ import annotations

import asyncio
import itertools
import uuid

import grpc

from coordinator.request import RequestStats
from coordinator.round_report import RequestUpdate
from coordinator.scheduler_thread import SchedulerThread, Sink
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


def _error_status(update: RequestUpdate) -> tuple[grpc.StatusCode, str]:
    kind, error = update.error_kind, update.error or "request failed"
    if kind == "unavailable":
        return grpc.StatusCode.UNAVAILABLE, f"the service is unavailable: {error}; retry later"
    if kind == "deadline":
        return grpc.StatusCode.DEADLINE_EXCEEDED, error
    return grpc.StatusCode.INTERNAL, f"the request failed inside the service: {error}"


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, scheduler: SchedulerThread, tokenizer):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.draining = False
        self.in_flight = 0
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._idle: asyncio.Event | None = None  # set whenever in_flight drops to 0

    async def Generate(self, request, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")
        if self.scheduler.ready.is_set() and self.scheduler.start_error is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the engine failed to start: {self.scheduler.start_error}")
        try:
            req = request_from_proto(request, self.tokenizer, f"{self._prefix}-{next(self._ids)}",
                                     context.time_remaining())
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        updates: asyncio.Queue = asyncio.Queue()
        done = False

        def on_done(_ctx) -> None:  # the RPC ended, however it ended: drop the request if it still runs
            if not done:
                self.scheduler.abort(req.req_id)

        context.add_done_callback(on_done)
        self._enter()
        try:
            self.scheduler.submit(req, Sink(asyncio.get_running_loop(), updates))
            while True:
                item = await updates.get()
                if isinstance(item, ValueError):
                    done = True
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(item))
                update: RequestUpdate = item
                if update.error_kind or (update.finished and update.error):
                    done = True
                    await context.abort(*_error_status(update))
                response = generation_pb2.GenerateResponse(token_ids=update.token_ids, text=update.text)
                if update.finished:
                    done = True
                    response.finish_reason = update.finish_reason or ""
                    response.stats.CopyFrom(stats_to_proto(update.stats))
                    yield response
                    return
                if update.token_ids or update.text:
                    yield response
        finally:
            if not done:  # cancelled (client gone, deadline, server stop): free its blocks now
                done = True
                self.scheduler.abort(req.req_id)
            self._leave()

    def _enter(self) -> None:
        self.in_flight += 1
        if self._idle is not None:
            self._idle.clear()

    def _leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout: float | None) -> bool:
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
