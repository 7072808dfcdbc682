"""One public endpoint in front of N target replicas, each a SchedulerThread (its own target worker,
KV cache and scheduler).

Terms: a replica is *serving* when its scheduler is built, its target answers and it is not being
drained. A new request goes to the serving replica with the fewest waiting requests (its last
round report's queue depth plus what was routed to it since), then the most free KV blocks, ties
broken round-robin; it stays there until it ends, unless its replica's target is lost: then, if
another replica serves, the request moves there (Scheduler.evict / adopt: its committed tokens
are re-fed, so the output is the same); if none does, it waits for the restarted worker
(coordinator.rounds.scheduler). While no replica serves, new requests go to one that is still loading or
restarting and wait there. The Router has the SchedulerThread surface the
servers use (submit, abort, ready, failure, on_round, ...), so one replica and many look alike.

With a `launcher` and a ReplicaConfig whose max_replicas > min_replicas, a scaling thread asks
ScalePolicy every `tick_s` and adds a replica (the launcher starts its workers, which in a Ray
cluster makes the autoscaler add a node) or drains an idle one and then removes it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from coordinator.replicas.scale_policy import ReplicaLoad, ScalePolicy
from coordinator.replicas.scheduler_thread import OnRound, SchedulerThread, Sink
from coordinator.rounds.request import Request
from coordinator.rounds.round_report import RequestUpdate, RoundReport
from coordinator.rounds.scheduler import Scheduler
from specdec.config import ReplicaConfig

log = logging.getLogger(__name__)

SchedulerFactory = Callable[[], Scheduler]


class ReplicaLauncher(Protocol):
    """Starts and stops the workers of replicas added by autoscaling (Ray actors in a cluster)."""

    def add(self, index: int) -> SchedulerFactory:
        """Start replica `index`'s workers (may wait for a node); return its scheduler factory."""

    def remove(self, index: int) -> None:
        """Stop replica `index`'s workers (its requests have ended)."""


@dataclass
class Replica:
    thread: SchedulerThread
    queue_depth: int = 0  # from its last round report
    kv_blocks_free: int = 0
    target_down: bool = False
    routed_since_report: int = 0
    active: int = 0  # requests routed here and not yet ended
    draining: bool = False

    @property
    def index(self) -> int:
        return self.thread.replica

    @property
    def serving(self) -> bool:
        t = self.thread
        return t.is_ready and t.failure is None and not self.target_down and not self.draining

    @property
    def waiting(self) -> int:
        return self.queue_depth + self.routed_since_report


def pick_replica(replicas: list[Replica], last_choice: int = -1) -> Replica | None:
    """The routing rule: among serving replicas the fewest waiting, then the most free KV blocks,
    ties round-robin (the first index after `last_choice`); with none serving, one that may still
    serve (loading or restarting, not drained); None if there is no such replica."""
    candidates = [r for r in replicas if r.serving]
    if not candidates:
        candidates = [r for r in replicas if not r.draining and r.thread.start_error is None]
    if not candidates:
        return None
    best = min((r.waiting, -r.kv_blocks_free) for r in candidates)
    tied = sorted((r for r in candidates if (r.waiting, -r.kv_blocks_free) == best), key=lambda r: r.index)
    return next((r for r in tied if r.index > last_choice), tied[0])


class _AllReady:
    """`ready` of the router: set once every replica started with has been built (or failed)."""

    def __init__(self, router: Router):
        self._router = router

    def is_set(self) -> bool:
        return all(r.thread.ready.is_set() for r in self._router.initial)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for replica in self._router.initial:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not replica.thread.ready.wait(left):
                return False
        return True


class _RoutedSink:
    """A request's sink that tells the router when the request has ended."""

    def __init__(self, sink: Sink, on_end: Callable[[], None]):
        self.sink, self._on_end = sink, on_end

    def put(self, item: RequestUpdate | ValueError) -> None:
        if isinstance(item, ValueError) or item.finished:
            self._on_end()
        self.sink.put(item)


class Router:
    def __init__(self, factories: list[SchedulerFactory], on_round: OnRound | None = None,
                 record_round: OnRound | None = None, launcher: ReplicaLauncher | None = None,
                 replica_config: ReplicaConfig | None = None, tick_s: float = 0.5):
        if not factories:
            raise ValueError("a router needs at least one replica")
        self._on_round, self._record_round = on_round, record_round
        self._lock = threading.Lock()
        self._owner: dict[str, Replica] = {}
        self._moving: set[str] = set()
        self.moved_requests = 0  # requests that went on on another replica after a target was lost
        self._last_choice = -1
        self.replicas: list[Replica] = [self._new_replica(i, f) for i, f in enumerate(factories)]
        self.initial = list(self.replicas)
        self.ready = _AllReady(self)
        self.launcher, self.tick_s = launcher, tick_s
        scaling = launcher is not None and replica_config is not None and replica_config.autoscaling
        self.policy = ScalePolicy(replica_config) if scaling else None
        self._adding = 0
        self._next_index = len(factories)
        self._stop = threading.Event()
        self._scaler = threading.Thread(target=self._scale_loop, name="specdec-autoscaler", daemon=True)

    def _new_replica(self, index: int, factory: SchedulerFactory) -> Replica:
        thread = SchedulerThread(factory, self._on_round, record_round=self._recorder(), replica=index)
        return Replica(thread)

    def _recorder(self) -> OnRound:
        def record(report: RoundReport) -> None:
            self._observe(report)
            if self._record_round is not None:
                self._record_round(report)
        return record

    # -- the SchedulerThread surface ----------------------------------------------------------------
    def start(self) -> None:
        for replica in self.replicas:
            replica.thread.start()
        if self.policy is not None:
            self._scaler.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        for replica in list(self.replicas):
            replica.thread.stop(timeout)

    def submit(self, request: Request, sink: Sink) -> None:
        with self._lock:
            if request.req_id in self._owner:  # ids are unique across replicas (drafts may be shared)
                sink.put(ValueError(f"request id {request.req_id!r} is already in use"))
                return
            replica = self._choose()
            if replica is None:
                sink.put(RequestUpdate.failure(request.req_id, "no replica can take requests (all are being "
                                                               "removed or stopped)", "unavailable"))
                return
            self._owner[request.req_id] = replica
            replica.routed_since_report += 1
            replica.active += 1
        replica.thread.submit(request, _RoutedSink(sink, lambda: self._ended(request.req_id)))

    def abort(self, req_id: str) -> None:
        replica = self._ended(req_id)
        if replica is not None:
            replica.thread.abort(req_id)

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and self.start_error is None

    @property
    def start_error(self) -> BaseException | None:
        """Set only when no replica started: the service runs on whichever replicas did."""
        errors = [r.thread.start_error for r in self.initial]
        return errors[0] if all(e is not None for e in errors) else None

    @property
    def failure(self) -> str | None:
        """None while some replica can serve (or is still loading); else why none can."""
        failures = [r.thread.failure for r in self.replicas]
        if any(f is None for f in failures):
            return None
        if len(failures) == 1:
            return failures[0]
        return "; ".join(f"replica {r.index}: {f}" for r, f in zip(self.replicas, failures))

    @property
    def num_active(self) -> int:
        return sum(r.thread.num_active for r in self.replicas)

    @property
    def max_seq_len(self) -> int | None:
        """The context every replica serves (they run one model pair); None until one is built."""
        return next((r.thread.max_seq_len for r in self.replicas if r.thread.max_seq_len is not None), None)

    @property
    def scheduler(self) -> Scheduler | None:
        """The first built replica's scheduler (for model facts and tests; not thread-safe)."""
        return next((r.thread.scheduler for r in self.replicas if r.thread.scheduler is not None), None)

    @property
    def on_round(self) -> OnRound | None:
        return self._on_round

    @on_round.setter
    def on_round(self, hook: OnRound | None) -> None:
        self._on_round = hook
        for replica in self.replicas:
            replica.thread.on_round = hook

    # -- routing ---------------------------------------------------------------------------------------
    def _choose(self) -> Replica | None:
        """Called with the lock held."""
        choice = pick_replica(self.replicas, self._last_choice)
        if choice is not None:
            self._last_choice = choice.index
        return choice

    def _ended(self, req_id: str) -> Replica | None:
        with self._lock:
            replica = self._owner.pop(req_id, None)
            if replica is not None:
                replica.active -= 1
            return replica

    def _observe(self, report: RoundReport) -> None:
        """Each replica's round report, on its scheduler thread: the load it routes by."""
        replica = next((r for r in self.replicas if r.index == report.replica), None)
        if replica is None:
            return
        with self._lock:
            replica.queue_depth = report.queue_depth
            replica.kv_blocks_free = report.kv_blocks_total - report.kv_blocks_used
            replica.target_down = "target" in report.workers_down
            replica.routed_since_report = 0
            moves = self._plan_moves(replica) if replica.target_down and replica.active else []
        for req_id, destination in moves:
            replica.thread.evict(req_id, lambda moved, sink, r=req_id, d=destination: self._deliver(r, d, moved, sink))

    def _plan_moves(self, source: Replica) -> list[tuple[str, Replica]]:
        """Its target lost: where each of `source`'s requests goes on (none if no other replica
        serves). Called with the lock held, on the source's scheduler thread."""
        moves = []
        for req_id, owner in list(self._owner.items()):
            if owner is not source or req_id in self._moving:
                continue
            destination = self._choose()
            if destination is None or not destination.serving:
                break
            self._owner[req_id] = destination
            source.active -= 1
            destination.active += 1
            destination.routed_since_report += 1
            self._moving.add(req_id)
            moves.append((req_id, destination))
        return moves

    def _deliver(self, req_id: str, destination: Replica, moved, sink) -> None:
        """On the source's thread: hand an evicted request to its new replica."""
        with self._lock:
            self._moving.discard(req_id)
        if moved is None or sink is None:  # it ended (or was cancelled) before it could move
            return
        self.moved_requests += 1
        log.warning("request %s moves to replica %d (its target was lost)", req_id, destination.index)
        destination.thread.adopt(moved, sink)

    # -- autoscaling -----------------------------------------------------------------------------------
    def loads(self) -> list[ReplicaLoad]:
        with self._lock:
            return [ReplicaLoad(r.index, r.waiting, r.active, r.serving) for r in self.replicas if not r.draining]

    def _scale_loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self._scale_step()
            except Exception:  # noqa: BLE001 - scaling must never stop serving
                log.exception("autoscaling step failed")

    def _scale_step(self) -> None:
        decision = self.policy.decide(time.monotonic(), self.loads(), pending=self._adding)
        if decision.add:
            with self._lock:
                self._adding += 1
            index, self._next_index = self._next_index, self._next_index + 1
            threading.Thread(target=self._add, args=(index,), name=f"specdec-add-replica-{index}",
                             daemon=True).start()
        if decision.remove is not None:
            with self._lock:
                replica = next((r for r in self.replicas if r.index == decision.remove), None)
                if replica is not None:
                    replica.draining = True
            if replica is not None:
                log.info("autoscaling: draining replica %d (idle)", replica.index)
                threading.Thread(target=self._remove, args=(replica,), name=f"specdec-remove-replica-{replica.index}",
                                 daemon=True).start()

    def _add(self, index: int) -> None:
        try:
            log.info("autoscaling: adding replica %d", index)
            replica = self._new_replica(index, self.launcher.add(index))
            replica.thread.start()
            with self._lock:
                self.replicas.append(replica)
        except Exception:  # noqa: BLE001 - retried on a later decision
            log.exception("autoscaling: could not add replica %d", index)
        finally:
            with self._lock:
                self._adding -= 1

    def _remove(self, replica: Replica) -> None:
        """Drain: no new requests reach it; wait until its requests have ended, then stop it."""
        while replica.active > 0 or replica.thread.num_active > 0:
            if self._stop.wait(self.tick_s):
                return
        replica.thread.stop(30.0)
        with self._lock:
            self.replicas.remove(replica)
        try:
            self.launcher.remove(replica.index)
        except Exception:  # noqa: BLE001
            log.exception("autoscaling: could not stop the workers of replica %d", replica.index)
        log.info("autoscaling: removed replica %d", replica.index)
