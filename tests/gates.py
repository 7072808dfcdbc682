"""What tests wait on instead of the machine's speed.

A test that needs the service to be in some state when it looks (a stream still running when a
worker dies, a queue still backed up when the autoscaler samples it, a request still unfinished
when its client goes away) must not get there by racing: a machine 10x faster finishes first, one
3x slower misses a short deadline. It holds the service there instead, and lets it go on once it
has looked:

- RoundGate: an `on_round` hook that stops a scheduler thread after a chosen round until the test
  opens it (nothing else happens on that replica meanwhile: no round, no admission, no abort);
- Calls: records the calls of one method (a Router's `submit` or `abort`), so a test can wait for
  a request to have reached the scheduler, or for its abort to have been sent;
- wait_until: polls a condition, with a timeout that only bounds a hang.

SPECDEC_TEST_PACE (tests/conftest.py) makes the service slower or the tests' looking slower, to
prove that no test depends on the pace; `wait_until` looks less often under "fast".
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

PACE = os.environ.get("SPECDEC_TEST_PACE", "").strip().lower() or "default"
PACES = ("default", "slow", "fast")
# Under "fast" the test looks late and seldom: the service is ~10x faster relative to it.
POLL_S = 0.2 if PACE == "fast" else 0.01
# The longest a gate holds or a wait lasts: only a broken test (or service) gets there.
HANG_S = 120.0


def wait_until(predicate: Callable[[], object], timeout: float = 30.0) -> bool:
    """True once `predicate()` is true; False if it still is not after `timeout` seconds (which
    only bounds a hang: pass a state the test controls, not one it hopes to catch in passing)."""
    end = time.monotonic() + timeout
    if PACE == "fast":
        time.sleep(POLL_S)
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(POLL_S)
    return bool(predicate())


def streamed_a_running_request(report) -> bool:
    """The default round a RoundGate holds after: one that streamed tokens of a request that goes
    on. Not just any round: a hook set right after a request ended may still be called for that
    request's last round (it runs after the round's updates went out)."""
    return report.ran and any(u.token_ids and not u.finished for u in report.updates)


class RoundGate:
    """An `on_round` hook (SchedulerThread / Router) that holds the scheduler thread after the
    first round `holds(report)` picks until `open()`; from then on it never holds again.

    The hook runs after the round's updates went out, so a client has the held round's tokens;
    while it holds, the replica runs no round and handles no submission or abort (they queue
    in its inbox and are handled, in order, once the gate opens). Open it in a `finally`: a
    server stops only once its scheduler thread is free."""

    def __init__(self, holds: Callable[[object], bool] = streamed_a_running_request):
        self.holds = holds
        self.held = threading.Event()  # the scheduler thread is (or was) waiting at the gate
        self.report = None  # the round it held after
        self._open = threading.Event()

    def __call__(self, report) -> None:
        if self._open.is_set() or not self.holds(report):
            return
        self.report = report
        self.held.set()
        self._open.wait(HANG_S)

    def open(self) -> None:
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def wait_held(self, timeout: float = HANG_S):
        """The report of the round it holds after (fails if no such round came)."""
        assert self.held.wait(timeout), f"no round to hold after within {timeout}s"
        return self.report

    def held_request_ids(self) -> list[str]:
        return [u.req_id for u in self.wait_held().updates]


class Calls:
    """Records every call of `owner.<name>` (the real method runs first) until the `with` block
    ends, so a test can wait for a call it caused on another thread (the server's event loop)."""

    def __init__(self, owner, name: str):
        self.owner, self.name = owner, name
        self.calls: list[tuple] = []
        self._real = getattr(owner, name)
        self._changed = threading.Condition()

    def __enter__(self) -> Calls:
        setattr(self.owner, self.name, self._record)
        return self

    def __exit__(self, *exc) -> None:
        delattr(self.owner, self.name)  # the class's method again

    def _record(self, *args):
        result = self._real(*args)
        with self._changed:
            self.calls.append(args)
            self._changed.notify_all()
        return result

    def wait_for(self, matches: Callable[[list[tuple]], bool], timeout: float = HANG_S) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: matches(self.calls), timeout)

    def wait_count(self, n: int, timeout: float = HANG_S) -> bool:
        return self.wait_for(lambda calls: len(calls) >= n, timeout)

    def wait_first_arg(self, value, timeout: float = HANG_S) -> bool:
        """A call whose first argument is `value` (e.g. abort(req_id))."""
        return self.wait_for(lambda calls: any(args and args[0] == value for args in calls), timeout)
