"""How `specdec serve` takes SIGTERM / SIGINT: the first one drains, a second exits at once
(`DrainSignals`); and, when the command starts Ray itself, serving from a child that leads a
session of its own, so that a signal to the command's process group reaches only the command
(`in_own_session`), which relays it.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import traceback

from specdec_app.serve_messages import ServeError, print_error


class DrainSignals:
    """First SIGTERM/SIGINT: set `stop` (drain). Second: exit at once with status 1."""

    def __init__(self):
        self.stop = threading.Event()
        self.received: str | None = None
        self.install()

    def install(self) -> None:
        """(Re)install the handlers: ray.init replaces the SIGTERM handler with its own."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.stop.is_set():
            print("specdec: second signal, exiting without draining", file=sys.stderr, flush=True)
            os._exit(1)
        self.received = signal.Signals(signum).name
        self.stop.set()

    def wait(self) -> None:
        # Event.wait with a timeout lets the main thread run the Python signal handler promptly.
        while not self.stop.wait(0.5):
            pass


def in_own_session(serve) -> int:
    """Run `serve()` in a forked child that leads a session of its own, and relay SIGTERM / SIGINT
    to it; returns its exit status.

    Ray starts its processes (GCS, raylet, dashboard) in the caller's process group, and they die
    at once on SIGTERM: a signal to the whole group killed the actors holding the in-flight
    streams, and the drain then blocked on Ray's 60 s reconnect to a GCS that was gone. In the
    child's own session only this command signals them. The child is told SIGTERM if this process
    dies first (PR_SET_PDEATHSIG), so it never outlives the command. Without fork (not POSIX),
    or where threads already run (fork would copy their locks), serve() runs here as before."""
    if not hasattr(os, "fork") or threading.active_count() > 1:
        return serve()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child, measured through the serve tests
        status = 1
        try:
            os.setsid()
            _die_with_parent()
            status = serve()
        except ServeError as e:
            print_error(e)
            status = 2
        except BaseException:  # noqa: BLE001 - report it; the child must not return into the CLI
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)

    def relay(signum, _frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, relay)
    _, status = os.waitpid(child, 0)  # (retried after each relayed signal: PEP 475)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code  # killed by signal n: the shell's 128 + n


def _die_with_parent() -> None:
    """SIGTERM to this process when its parent exits (Linux; elsewhere nothing)."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl: nobody would signal us
        os.kill(os.getpid(), signal.SIGTERM)
