"""Failover: what a lost worker costs its requests (a pause, not their output), and the releases
each worker is still owed.

The coordinator holds every committed token. When the target is lost, each request is released
there and re-admitted with its prompt plus the tokens committed so far (a fresh first round) once
the target answers again; when the draft is lost, its copies are reset likewise and rounds go on
without speculation meanwhile, except for seeded sampled requests, which wait for it (K = 0
rounds would decide their tokens with other random draws than an uninterrupted run). Only a
worker gone longer than worker_recovery_timeout, or one that will not be restarted (WorkerGone),
fails its requests. A retired request's cache is released on each worker with the next call
that reaches it; a release that fails (worker down) is kept and retried.
"""
from __future__ import annotations

import time

from coordinator.rounds.clients import DraftClient, TargetClient
from coordinator.rounds.errors import WorkerUnavailable
from coordinator.rounds.request import RunningRequest
from coordinator.rounds.round_report import RequestUpdate
from coordinator.rounds.worker_health import WorkerHealth
from specdec.config import SchedulerConfig

RELEASE_RETRY_S = 1.0  # after a failed release (worker down), wait this long instead of spinning on it


class Failover:
    def __init__(self, config: SchedulerConfig):
        self.target_health = WorkerHealth("target", config.worker_recovery_timeout)
        self.draft_health = WorkerHealth("draft", config.worker_recovery_timeout)
        self.release_target: list[str] = []  # retired requests whose target cache is still held
        self.release_draft: list[str] = []  # the same on the draft
        self._retry_at = 0.0

    def retired(self, req_id: str, run: RunningRequest) -> None:
        """A request left this scheduler: free its cache on the workers that hold it."""
        if run.started_target:
            self.release_target.append(req_id)
        if run.num_speculative_tokens > 0:
            self.release_draft.append(req_id)

    def releases_due(self, now: float) -> bool:
        return bool(self.release_target or self.release_draft) and now >= self._retry_at

    def paused(self, run: RunningRequest, seeded: bool) -> bool:
        """Seeded sampled requests wait while the draft is lost (but not past its recovery timeout)."""
        health = self.draft_health
        return not health.up and run.num_speculative_tokens > 0 and seeded and not health.given_up()

    def target_lost(self, exc: WorkerUnavailable, running: dict[str, RunningRequest]) -> None:
        """Every request the target held is gone there: release it, and re-admit it with all of
        its committed tokens on the next round that reaches the target."""
        self.target_health.lost(exc)
        for req_id, run in running.items():
            if run.started_target:
                run.started_target = False
                if req_id not in self.release_target:
                    self.release_target.append(req_id)

    def draft_lost(self, exc: WorkerUnavailable, running: dict[str, RunningRequest]) -> None:
        """The draft's copies of the sequences are gone (or stale): when it answers again, each
        request is released there and sent its whole context."""
        self.draft_health.lost(exc)
        self.reset_draft_copies([req_id for req_id, run in running.items() if run.num_speculative_tokens > 0],
                                running)

    def reset_draft_copies(self, req_ids: list[str], running: dict[str, RunningRequest]) -> None:
        """The draft's copies of these requests may hold tokens it was not meant to record: drop
        them there, and send each request's whole context with its next task."""
        for req_id in req_ids:
            run = running.get(req_id)
            if run is not None:
                run.unsent_to_draft = run.request.prompt_ids + run.generated
            if req_id not in self.release_draft:
                self.release_draft.append(req_id)

    def target_answers(self, target: TargetClient) -> int | None:
        """Is a target that was given up on back? An empty round delivering pending releases:
        the target's KV blocks in use, or None (still gone)."""
        finished, self.release_target = self.release_target, []
        try:
            used = target.verify([], finished).kv_blocks_used
        except Exception as exc:  # noqa: BLE001 - still gone
            self.release_target = finished + self.release_target
            self.target_health.lost(exc)
            return None
        self.target_health.back()
        return used

    def flush(self, target: TargetClient, draft: DraftClient | None) -> int | None:
        """Free the cache of retired requests even when nothing else is running; the target's KV
        blocks in use when it answered (None: no target call, or it failed)."""
        used = None
        if self.release_draft and draft is not None:
            finished, self.release_draft = self.release_draft, []
            try:
                draft.propose([], finished)
            except Exception:  # noqa: BLE001 - kept and retried
                self.release_draft = finished + self.release_draft
                self._retry_at = time.monotonic() + RELEASE_RETRY_S
        if self.release_target:
            finished, self.release_target = self.release_target, []
            try:
                used = target.verify([], finished).kv_blocks_used
            except Exception:  # noqa: BLE001 - kept and retried
                self.release_target = finished + self.release_target
                self._retry_at = time.monotonic() + RELEASE_RETRY_S
        return used


def failures(runs: list[RunningRequest], exc: Exception) -> list[RequestUpdate]:
    """The last updates of requests a round failed (the caller retires them)."""
    kind = "unavailable" if isinstance(exc, WorkerUnavailable) else "internal"
    return [RequestUpdate.failure(run.request.req_id, f"{type(exc).__name__}: {exc}", kind, stats=run.stats)
            for run in runs]
