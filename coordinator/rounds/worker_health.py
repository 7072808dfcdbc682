"""Whether a worker answers, and when to try it again after it stopped.

A worker that stops answering (its process died, or hung past the round deadline) is usually
being restarted by Ray. Its requests wait meanwhile: the scheduler retries with a backoff that
starts at a few tens of milliseconds and is capped at MAX_BACKOFF_S, so a worker that is back is
used again within about a second. Only when it has been gone longer than the recovery timeout, or its
supervisor says it will not come back (WorkerGone: Ray has no restarts left), are its requests
failed; the scheduler keeps probing, so a worker deployed again is used again.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from coordinator.rounds.errors import WorkerGone

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0


@dataclass
class WorkerHealth:
    role: str  # "target" | "draft"
    recovery_timeout: float  # seconds a lost worker may take to come back
    down_since: float | None = None  # time.monotonic() of the first failure of this outage
    retry_at: float = 0.0
    failures: int = 0  # consecutive failed attempts in this outage
    last_error: str = ""
    outages: int = 0  # over the scheduler's life
    gone: bool = False  # the last failure said it will not come back by itself

    @property
    def up(self) -> bool:
        return self.down_since is None

    def due(self, now: float | None = None) -> bool:
        """May the worker be called now: it is up, or its next retry is due."""
        return self.up or (time.monotonic() if now is None else now) >= self.retry_at

    def wait_seconds(self, now: float | None = None) -> float:
        """Until the next retry (0 when the worker is up or a retry is due)."""
        return 0.0 if self.up else max(self.retry_at - (time.monotonic() if now is None else now), 0.0)

    def lost(self, error: Exception, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.down_since is None:
            self.down_since = now
            self.outages += 1
        self.failures += 1
        self.retry_at = now + min(FIRST_BACKOFF_S * 2 ** (self.failures - 1), MAX_BACKOFF_S)
        self.last_error = f"{type(error).__name__}: {error}"
        self.gone = isinstance(error, WorkerGone)

    def back(self) -> bool:
        """The worker answered; True if it had been down (its requests were resumed)."""
        was_down = self.down_since is not None
        self.down_since, self.failures, self.gone = None, 0, False
        return was_down

    def given_up(self, now: float | None = None) -> bool:
        """Gone for good, or down for longer than the recovery timeout: its requests should fail."""
        if self.down_since is None:
            return False
        now = time.monotonic() if now is None else now
        return self.gone or now - self.down_since > self.recovery_timeout

    def describe(self) -> str:
        if self.gone:
            return f"the {self.role} worker is gone and will not be restarted: {self.last_error}"
        return f"the {self.role} worker has been unavailable for longer than {self.recovery_timeout:g}s " \
               f"(restarts exhausted?); last error: {self.last_error}"
