"""`specdec serve` with a Ray instance of its own, stopped the ways a supervisor stops it (issue 22):
SIGTERM to the command's whole process group (systemd's default KillMode), SIGINT to the command
alone with a grace period too short for the stream in flight, and Ray's processes stopped before
the command. Each time the command exits 0 within its grace period + 5 s, and an in-flight stream
that can finish within the grace period does.

The stream is kept in flight by a gate the test holds, not by the machine's speed: the target
worker's actor process is stopped (SIGSTOP) before the request starts, the test waits for the
call's initial metadata (the server sends it once it has accepted the request), and the target is
continued (SIGCONT) once the test has seen the drain begin.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from coordinator.frontend.servicer import REQUEST_ID_METADATA
from specdec.v1 import generation_pb2, generation_pb2_grpc

from checkpoints import CONFIGS, build_checkpoint, perturbed_copy

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [3, 17, 42, 5, 99, 7, 3, 17]
NEW_TOKENS = 64
EXIT_MARGIN_S = 5.0  # the command exits within its grace period + this (the bound)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("serve-signals")
    target = build_checkpoint(base / "target", seed=0, **CONFIGS["gqa_untied"])
    return target, perturbed_copy(target, base / "draft", noise=0.1)


def _children() -> dict[int, list[int]]:
    """ppid -> pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def descendants(pid: int) -> dict[int, str]:
    """Every process below pid: pid -> its command line."""
    tree, found, todo = _children(), {}, [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            try:
                found[child] = (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            todo.append(child)
    return found


def find(pid: int, marker: str) -> list[int]:
    return [p for p, cmdline in descendants(pid).items() if marker in cmdline]


class Serve:
    """`specdec serve` (its own local Ray) in a process group of its own, its stdout read by a thread."""

    def __init__(self, models, grace_s: float):
        from specdec_app.ray_cluster import free_port

        target, draft = models
        self.port = free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specdec_app.cli", "serve", "--target", str(target), "--draft", str(draft),
             "--host", "127.0.0.1", "--port", str(self.port), "--http-port", "0", "--name", "specdec-signals",
             "--grace-period", str(grace_s), "--worker-round-timeout", "300", "--dashboard-port", "0", "--quiet"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_line(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            self.seen.append(line)
            if needle in line:
                return line
        raise AssertionError(f"no {needle!r} line; output:\n" + "\n".join(self.seen))

    def stream_held_in_flight(self):
        """Once serving: the target worker's process stopped (SIGSTOP: the gate: no token can be
        made until the test continues it), then a request started and accepted by the server (its
        initial metadata names it); (stream, the target's pid). Stopping the target only after a
        first token left the rest of the request a window to finish in on a fast machine."""
        self.wait_line("specdec serving", 180)
        [target] = find(self.proc.pid, "TargetWorkerActor")
        os.kill(target, signal.SIGSTOP)
        request = generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                                 num_speculative_tokens=0)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        stream = generation_pb2_grpc.GenerationStub(self.channel).Generate(request, timeout=300)
        assert dict(stream.initial_metadata()).get(REQUEST_ID_METADATA), "the server accepted the request"
        return stream, target

    def exit_seconds(self, since: float, limit: float) -> tuple[int, float]:
        """(exit status, seconds from `since` until the command exited), waiting up to `limit` s;
        the output so far is in `seen`."""
        status = self.proc.wait(timeout=limit)
        seconds = time.monotonic() - since
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                self.seen.append(self.lines.get(timeout=0.2))
            except queue.Empty:
                break
        return status, seconds

    def close(self) -> None:
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        self.proc.wait(10)


def refused_while_draining(port: int, timeout: float = 30.0) -> grpc.RpcError:
    """A new request's error once the server drains (the "draining" line is printed just before
    the coordinator is told, so a request may still slip in first: it then completes)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while time.monotonic() < deadline:
            try:
                list(stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=1),
                                   timeout=2))
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # (a request that slipped in)
                    return error
            time.sleep(0.05)
    raise AssertionError("new requests were still accepted while draining")


def test_sigterm_to_the_whole_group_drains_the_stream_in_flight_and_exits_0(models):
    grace = 60.0
    serve = Serve(models, grace)
    try:
        stream, target = serve.stream_held_in_flight()
        tokens: list[int] = []
        signalled = time.monotonic()
        os.killpg(serve.proc.pid, signal.SIGTERM)  # what systemd's KillMode=control-group sends
        serve.wait_line("draining", 30)
        assert refused_while_draining(serve.port).code() == grpc.StatusCode.UNAVAILABLE
        assert find(serve.proc.pid, "raylet"), "the group signal reached Ray's own processes"
        os.kill(target, signal.SIGCONT)
        for response in stream:
            tokens.extend(response.token_ids)
            last = response
        assert last.finish_reason == "length" and len(tokens) == NEW_TOKENS
        status, seconds = serve.exit_seconds(signalled, grace + EXIT_MARGIN_S)
        assert status == 0, "\n".join(serve.seen)
        assert seconds <= grace + EXIT_MARGIN_S
        assert any("specdec: stopped" in line for line in serve.seen)
    finally:
        serve.close()


def test_sigint_with_a_stream_longer_than_the_grace_period_exits_0_within_grace_plus_5s(models):
    """The stream cannot finish (its target stays stopped): it is cancelled when the grace period
    ends, and every call the shutdown path makes into Ray is bounded."""
    grace = 2.0
    serve = Serve(models, grace)
    try:
        stream, _ = serve.stream_held_in_flight()
        signalled = time.monotonic()
        serve.proc.send_signal(signal.SIGINT)  # the command alone (it relays to its service)
        status, seconds = serve.exit_seconds(signalled, grace + EXIT_MARGIN_S + 30)
        assert status == 0, "\n".join(serve.seen)
        assert seconds <= grace + EXIT_MARGIN_S, f"exited {seconds:.1f}s after SIGINT (grace {grace:g}s)"
        with pytest.raises(grpc.RpcError):
            for _ in stream:
                pass
    finally:
        serve.close()


def test_ray_processes_stopped_first_then_the_command_exits_0_at_once(models):
    grace = 30.0
    serve = Serve(models, grace)
    try:
        stream, _ = serve.stream_held_in_flight()  # still in flight when Ray goes
        ray_processes = find(serve.proc.pid, "gcs_server") + find(serve.proc.pid, "raylet --")
        assert len(ray_processes) == 2, descendants(serve.proc.pid)
        for pid in ray_processes:
            os.kill(pid, signal.SIGTERM)
        signalled = time.monotonic()
        serve.proc.send_signal(signal.SIGTERM)
        status, seconds = serve.exit_seconds(signalled, grace + EXIT_MARGIN_S + 60)
        assert status == 0, "\n".join(serve.seen)
        assert seconds <= grace + EXIT_MARGIN_S
        # Nothing was drained: the stream fails, or ends complete where the actors outlive Ray for
        # a moment: raylet's exit orphans the stopped target's process group, and the kernel then
        # continues it (SIGHUP, SIGCONT), so it may finish the request before the coordinator's
        # process is gone. Never a partial stream ending OK.
        tokens, last = [], None
        try:
            for response in stream:
                tokens.extend(response.token_ids)
                last = response
        except grpc.RpcError:
            return
        assert last is not None and last.finish_reason == "length" and len(tokens) == NEW_TOKENS
    finally:
        serve.close()
