"""When to add or remove a target replica: a pure decision from the replicas' load over time.

Terms: a replica is *backed up* when more requests wait on it than `scale_up_queue`; *idle* when
it has no request at all. The service scales up by one when every serving replica has been backed
up for `scale_window` seconds (one busy replica is the router's job, not a reason to grow), and
scales down by one when a replica has been idle for `scale_down_idle` seconds, never leaving the
[min_replicas, max_replicas] range (ReplicaConfig). Decisions are spaced by the window, so a
replica that was just added gets time to take load before the next one is asked for.
"""
from __future__ import annotations

from dataclasses import dataclass

from specdec.config import ReplicaConfig


@dataclass(frozen=True)
class ReplicaLoad:
    index: int
    waiting: int  # requests routed to it and not yet running
    active: int  # requests routed to it and not yet finished (waiting included)
    serving: bool  # ready, healthy and not draining


@dataclass(frozen=True)
class ScaleDecision:
    add: bool = False
    remove: int | None = None  # the index of the replica to drain and remove


class ScalePolicy:
    def __init__(self, config: ReplicaConfig):
        self.config = config
        self._backed_up_since: float | None = None
        self._idle_since: dict[int, float] = {}
        self._last_change = float("-inf")

    def decide(self, now: float, loads: list[ReplicaLoad], pending: int = 0) -> ScaleDecision:
        """`loads`: every replica not being removed; `pending`: replicas being added."""
        c = self.config
        serving = [load for load in loads if load.serving]
        backed_up = bool(serving) and all(load.waiting > c.scale_up_queue for load in serving)
        self._backed_up_since = (self._backed_up_since or now) if backed_up else None
        for load in loads:
            if load.active:
                self._idle_since.pop(load.index, None)
            else:
                self._idle_since.setdefault(load.index, now)
        self._idle_since = {i: t for i, t in self._idle_since.items() if any(x.index == i for x in loads)}
        if now - self._last_change < c.scale_window:
            return ScaleDecision()
        count = len(loads) + pending
        if backed_up and now - self._backed_up_since >= c.scale_window and count < c.highest:
            return self._changed(now, ScaleDecision(add=True))
        if pending == 0 and count > c.lowest:
            idle = [i for i, since in self._idle_since.items() if now - since >= c.scale_down_idle]
            if idle:
                return self._changed(now, ScaleDecision(remove=max(idle)))
        return ScaleDecision()

    def _changed(self, now: float, decision: ScaleDecision) -> ScaleDecision:
        self._last_change = now
        self._backed_up_since = None
        if decision.remove is not None:
            self._idle_since.pop(decision.remove, None)
        return decision
