"""Commit and streaming: what a round's verdict adds to a request, after its stop conditions.

Stop conditions (max_new_tokens, EOS, stop strings) apply to committed tokens only, in order, so
a request never streams a token past its end; the text streamed is the detokenized difference
(coordinator.rounds.text_stream), held back while it could still be the start of a stop string.
"""
from __future__ import annotations

import time

from coordinator.rounds.request import RunningRequest
from coordinator.rounds.round_report import RequestUpdate


def commit(run: RunningRequest, tokens: list[int], eos_ids: set[int]) -> RequestUpdate:
    """Add the verdict's tokens to `run` up to its first stop; the update to stream (finished,
    with its reason and stats, when a stop was reached: the caller retires the request)."""
    params = run.request.params
    reason = None
    kept = []
    for token in tokens:
        kept.append(token)
        if len(run.generated) + len(kept) >= params.max_new_tokens:
            reason = "length"
        if token in eos_ids and not params.ignore_eos:
            reason = "eos"
        if reason:
            break
    kept, text, stop_hit = run.stream.add(kept)
    if stop_hit:
        reason = "stop"
    run.generated.extend(kept)
    run.unsent_to_draft.extend(kept)
    run.stats.generated = len(run.generated)
    update = RequestUpdate(req_id=run.request.req_id, token_ids=kept, text=text)
    if reason:
        update.text += run.stream.finish() if reason != "stop" else ""
        update.finished, update.finish_reason, update.stats = True, reason, run.stats
    return update


def past_deadline(running: dict[str, RunningRequest]) -> list[RunningRequest]:
    """Running requests whose deadline passed (the caller retires them with `deadline_update`)."""
    now = time.monotonic()
    return [run for run in running.values() if run.request.deadline is not None and run.request.deadline <= now]


def deadline_update(run: RunningRequest) -> RequestUpdate:
    return RequestUpdate.failure(run.request.req_id, "deadline exceeded", "deadline", stats=run.stats,
                                 text=run.stream.finish())
