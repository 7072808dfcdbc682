"""The Scheduler on one dedicated thread, fed by a thread-safe inbox.

The scheduler is not thread-safe, so exactly one thread calls `step()`. Submissions and aborts
reach it through a queue drained before each round; when there is no work the thread blocks on
that queue instead of spinning. Each round's updates go to per-request sinks (asyncio queues of
the servers' event loops) and the whole RoundReport to the `on_round` hook (metrics).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.rounds.request import Request
from coordinator.rounds.round_report import RequestUpdate, RoundReport
from coordinator.rounds.scheduler import Scheduler

log = logging.getLogger(__name__)

OnRound = Callable[[RoundReport], None]


@dataclass
class Sink:
    """Where one request's updates go: an asyncio queue on its server's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestUpdate | ValueError) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


_STOP = object()


class SchedulerThread:
    """`scheduler_factory` is called on the thread (model loading never blocks an event loop);
    requests submitted before it returns wait in the inbox. After every step, on the thread,
    `record_round(report)` (the server's own metrics) runs before the updates go out and
    `on_round(report)` (the caller's hook, which tests swap freely) after; an exception in either
    is logged and ignored. `replica` numbers the thread among the router's replicas; it is
    stamped on every report."""

    def __init__(self, scheduler_factory: Callable[[], Scheduler], on_round: OnRound | None = None,
                 record_round: OnRound | None = None, replica: int = 0):
        self._factory = scheduler_factory
        self.replica = replica
        self.on_round = on_round
        self.record_round = record_round
        self.scheduler: Scheduler | None = None
        self.ready = threading.Event()  # set once the scheduler exists (or failed to be made)
        self.start_error: BaseException | None = None
        self._crash: str | None = None  # set if the loop itself died
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, Sink] = {}
        # Aborts of ids this thread does not hold (yet): a request moving here may be cancelled
        # on the way (coordinator.replicas.router); the newest few are remembered.
        self._aborted_unknown: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._thread = threading.Thread(target=self._run, name=f"specdec-scheduler-{replica}", daemon=True)

    # -- called from any thread ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request, sink: Sink) -> None:
        """Queue a request. Its sink receives RequestUpdates, or one ValueError if it is invalid."""
        self._inbox.put(("add", request, sink))

    def abort(self, req_id: str) -> None:
        self._inbox.put(("abort", req_id))

    def evict(self, req_id: str, deliver: Callable) -> None:
        """Take a request out of this replica: `deliver(moved, sink)` is called on this thread
        with what Scheduler.evict returned (None if it ended first) and its sink."""
        self._inbox.put(("evict", req_id, deliver))

    def adopt(self, moved, sink: Sink) -> None:
        """Continue here a request evicted from another replica (Scheduler.adopt)."""
        self._inbox.put(("adopt", moved, sink))

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread: requests still queued or running end with UNAVAILABLE."""
        if self._thread.is_alive():
            self._inbox.put((_STOP,))
            self._thread.join(timeout)

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and self.start_error is None

    @property
    def failure(self) -> str | None:
        """Why requests cannot be served (the engine failed to start, the loop crashed, the target
        worker is given up on); None while they can, and while the model is still loading."""
        if self.start_error is not None:
            return f"the engine failed to start: {self.start_error}"
        if self._crash is not None:
            return self._crash
        scheduler = self.scheduler
        if scheduler is not None and not scheduler.healthy:
            return scheduler.target_health.describe()  # a benign race: read from another thread
        return None

    @property
    def max_seq_len(self) -> int | None:
        """The context length every request must fit; None until the scheduler is built."""
        scheduler = self.scheduler
        return scheduler.max_seq_len if scheduler is not None else None

    @property
    def num_active(self) -> int:
        return len(self._sinks)

    # -- the thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.scheduler = self._factory()
        except BaseException as e:  # noqa: BLE001 - reported to every request and to health
            log.exception("the scheduler failed to start")
            self.start_error = e
            self.ready.set()
            self._serve_failed(f"the engine failed to start: {type(e).__name__}: {e}")
            return
        self.ready.set()
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - never leave a client waiting for an answer
            log.exception("the scheduler loop crashed")
            message = f"the scheduler loop crashed: {type(e).__name__}: {e}"
            self._crash = message
            self._fail_everyone(message, "internal")
            self._serve_failed(message)

    def _loop(self) -> None:
        sched = self.scheduler
        while True:
            # Block when idle; otherwise take whatever arrived since the last round. The wait is
            # bounded: a retry of a lost worker, or releases that failed, become due on their own.
            block = not sched.has_work()
            wait = sched.wake_in()
            while True:
                try:
                    command = self._inbox.get(block=block, timeout=(1.0 if wait is None else wait) if block else None)
                except queue.Empty:
                    break
                block = False
                if command[0] is _STOP:
                    self._shutdown()
                    return
                self._handle(command)
            if not sched.has_work():
                continue
            try:
                report = sched.step()
            except Exception as e:  # noqa: BLE001 - a bug in a round fails its requests, not the server
                log.exception("a scheduler round raised")
                for req_id in list(self._sinks):
                    with contextlib.suppress(Exception):
                        sched.abort(req_id)
                self._fail_everyone(f"{type(e).__name__}: {e}", "internal")
                continue
            report.replica = self.replica
            # The server's metrics first, so a client that has its answer finds it counted.
            self._call(self.record_round, report)
            self._route(report.updates)
            if report.ran:
                log.debug("round: %d requests, %d tokens, draft %.1f ms, verify %.1f ms, overhead %.1f ms",
                          report.batch_size, report.committed_tokens, 1e3 * report.draft_seconds,
                          1e3 * report.verify_seconds, 1e3 * report.overhead_seconds)
            self._call(self.on_round, report)

    @staticmethod
    def _call(hook: OnRound | None, report: RoundReport) -> None:
        if hook is not None:
            try:
                hook(report)
            except Exception:  # noqa: BLE001 - metrics must never break serving
                log.exception("round hook %r failed", hook)

    def _handle(self, command) -> None:
        if command[0] == "add":
            _, request, sink = command
            try:
                self.scheduler.add_request(request)
            except ValueError as e:
                sink.put(e)
                return
            except Exception as e:  # noqa: BLE001
                log.exception("add_request raised")
                sink.put(RequestUpdate.failure(request.req_id, f"{type(e).__name__}: {e}", "internal"))
                return
            self._sinks[request.req_id] = sink
        elif command[0] == "abort":
            if self._sinks.pop(command[1], None) is not None:
                self.scheduler.abort(command[1])
            else:
                self._aborted_unknown[command[1]] = None
                while len(self._aborted_unknown) > 1024:
                    self._aborted_unknown.popitem(last=False)
        elif command[0] == "evict":
            _, req_id, deliver = command
            moved = self.scheduler.evict(req_id)
            deliver(moved, self._sinks.pop(req_id, None))
        elif command[0] == "adopt":
            _, (moved, state), sink = command
            req_id = _req_id(moved)
            if req_id in self._aborted_unknown:  # cancelled on its way here
                del self._aborted_unknown[req_id]
                return
            self.scheduler.adopt(moved, state)
            self._sinks[req_id] = sink

    def _route(self, updates: list[RequestUpdate]) -> None:
        for update in updates:
            sink = self._sinks.get(update.req_id)
            if sink is None:
                continue
            if update.finished:
                del self._sinks[update.req_id]
            sink.put(update)

    def _shutdown(self) -> None:
        for req_id in list(self._sinks):
            self.scheduler.abort(req_id)
        self._fail_everyone("the server is shutting down", "unavailable")
        self._fail_queued("the server is shutting down")
        with contextlib.suppress(Exception):
            self.scheduler.step()  # frees the workers' caches of what was aborted

    def _fail_everyone(self, message: str, kind: str) -> None:
        for req_id, sink in list(self._sinks.items()):
            sink.put(RequestUpdate.failure(req_id, message, kind))
        self._sinks.clear()

    def _serve_failed(self, message: str) -> None:
        """No scheduler: answer every submission with UNAVAILABLE until stopped."""
        while (command := self._inbox.get())[0] is not _STOP:
            _refuse(command, message)

    def _fail_queued(self, message: str) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            _refuse(command, message)


def _req_id(moved) -> str:
    return moved.req_id if isinstance(moved, Request) else moved.request.req_id


def _refuse(command, message: str) -> None:
    """Answer a command that will not be carried out: requests fail with UNAVAILABLE."""
    if command[0] == "add":
        command[2].put(RequestUpdate.failure(command[1].req_id, message, "unavailable"))
    elif command[0] == "adopt":
        command[2].put(RequestUpdate.failure(_req_id(command[1][0]), message, "unavailable"))
    elif command[0] == "evict":
        command[2](None, None)
