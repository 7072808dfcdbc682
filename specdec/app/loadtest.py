"""`specdec loadtest`: a bounded load test of the Generation service on loopback.

Opens N concurrent Generate streams (default 64 x 200 tokens, ignore_eos), cancels a fraction of
them after a random number of tokens, and checks that:

- every stream ends exactly once: a non-cancelled stream ends with a finish_reason on its last
  message and exactly max_new_tokens tokens (and the server's stats agree with the client's count);
  a cancelled stream ends with CANCELLED; nothing arrives after a finish; no stream is missing;
- with --verify-sample N, N completed streams replayed one at a time produce the same tokens
  (seeded sampling and greedy decoding do not depend on batching), which catches streams that
  received another stream's tokens;
- with --embedded, after the run every KV block of the target (and of the draft model) is free and
  the engine holds no request.

It reports throughput (generated tokens per second of wall time), p50/p99 time to first token,
inter-token latency per message and per token, the stream counts and the KV blocks still used.
With --embedded --grpc-workers the draft and target workers are served over loopback gRPC (as in a
deployment, minus the network) and the report adds the bytes on the wire per round: mean and p99 of
sent + received per round, split draft / target, and per generated token (protobuf payload bytes
of the Rounds messages; gRPC framing adds 5 bytes per message).
The exit status is 0 only if every check passed.

  specdec loadtest --address 127.0.0.1:50051
  specdec loadtest --embedded --draft models/draft --streams 64 --json out.json
  specdec loadtest --embedded --grpc-workers --draft models/draft --temperature 0.8

The embedded server takes the service settings of `specdec serve` (--target, --draft, -k, ...;
default target: the shipped model, default draft: none).

Everything stays bounded: --streams calls at most, --timeout seconds at most (hard), and in
embedded mode the server binds 127.0.0.1 on a free port and stops at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field

from specdec.app.flags import add_settings, given_settings
from specdec.config import ConfigError, ServiceConfig

# The settings of the embedded server this command can change (the rest keep their defaults).
EMBEDDED_SETTINGS = ("target", "draft", "adaptive", "device", "dtype", "max_batch_size", "kv_cache_blocks",
                     "kv_block_size", "target_threads", "draft_threads")

WORDS = ("the quick brown fox jumps over the lazy dog speculative decoding drafts tokens and the target "
         "verifies them hello world stream text back to client").split()


# --- configuration and results -------------------------------------------------------------


@dataclass
class LoadConfig:
    streams: int = 64
    max_new_tokens: int = 200
    cancel_fraction: float = 0.1
    temperature: float | None = None
    seed: int = 0
    timeout: float = 300.0
    num_speculative_tokens: int | None = None
    vocab_size: int | None = None  # set: prompts are random token ids in [0, vocab_size) instead of text
    prompt_words: int = 8
    verify_sample: int = 0
    progress: bool = False
    token: str | None = None
    # Set: `streams` clients each send one request after another until this many seconds passed
    # (closed loop), instead of `streams` requests at once.
    duration: float | None = None
    mixed: bool = False  # every other stream greedy, the rest at `temperature` (0.8 if unset)


@dataclass
class StreamRecord:
    index: int
    tag: str
    prompt: object  # str or list[int]
    seed: int
    cancel_after: int | None  # cancel once this many tokens arrived (0: at once; None: run to the end)
    temperature: float | None = None  # None: greedy
    token_ids: list[int] = field(default_factory=list)
    messages: int = 0  # messages carrying tokens
    finish_messages: int = 0
    messages_after_finish: int = 0
    finish_reason: str = ""
    stats_generated: int | None = None
    stats_prompt_tokens: int | None = None
    status: str = "pending"  # completed | cancelled | failed | pending
    error: str = ""
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)  # seconds between token-bearing messages
    gaps_per_token: list[float] = field(default_factory=list)
    verified: bool = False  # replayed alone (--verify-sample)
    replay_error: str = ""


@dataclass
class LoadReport:
    streams: int
    max_new_tokens: int
    completed: int
    cancelled: int
    failed: int
    missing: int
    generated_tokens: int
    wall_seconds: float
    throughput_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_message_p50_ms: float | None
    itl_message_p99_ms: float | None
    itl_token_p50_ms: float | None
    itl_token_p99_ms: float | None
    kv_blocks_used_target: int | None = None
    kv_blocks_used_draft: int | None = None
    verified_streams: int = 0
    failures: list[str] = field(default_factory=list)
    wire: dict | None = None  # bytes on the wire per round (--grpc-workers), see WireRecorder.summary

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


# --- the streams ---------------------------------------------------------------------------


def stream_record(cfg: LoadConfig, run_id: str, i: int, cancel_after: int | None) -> StreamRecord:
    """Stream i's prompt, seed and sampling: a function of (cfg.seed, i) only, so a stream can be
    replayed elsewhere (chaos mode compares every stream with an uninterrupted run)."""
    rng = random.Random(cfg.seed * 1_000_003 + i)
    tag = f"{run_id}-{i}"
    if cfg.vocab_size:
        # Distinct by construction: the first two ids encode i; lengths vary with i too.
        v = cfg.vocab_size
        prompt = [i % v, (i // v) % v] + [rng.randrange(v) for _ in range(cfg.prompt_words + i % 5)]
    else:
        words = [rng.choice(WORDS) for _ in range(cfg.prompt_words + i % 5)]
        prompt = f"request {i}: " + " ".join(words)
    temperature = cfg.temperature
    if cfg.mixed:
        temperature = None if i % 2 == 0 else (cfg.temperature or 0.8)
    return StreamRecord(index=i, tag=tag, prompt=prompt, seed=cfg.seed * 100_003 + i, cancel_after=cancel_after,
                        temperature=temperature)


def make_streams(cfg: LoadConfig, run_id: str) -> list[StreamRecord]:
    rng = random.Random(cfg.seed)
    n_cancel = min(cfg.streams, int(round(cfg.streams * cfg.cancel_fraction)))
    cancelled = set(rng.sample(range(cfg.streams), n_cancel))
    records = []
    for i in range(cfg.streams):
        cancel_after = rng.randint(0, cfg.max_new_tokens - 1) if i in cancelled else None
        if n_cancel >= 2 and i == min(cancelled):
            cancel_after = 0  # one stream always leaves before its first message
        records.append(stream_record(cfg, run_id, i, cancel_after))
    return records


def _next_stream(cfg: LoadConfig, run_id: str, i: int) -> StreamRecord:
    """Duration mode: stream i, cancelled mid-way with probability cancel_fraction."""
    rng = random.Random(cfg.seed * 7_919 + i)
    cancel = rng.random() < cfg.cancel_fraction
    return stream_record(cfg, run_id, i, rng.randint(0, cfg.max_new_tokens - 1) if cancel else None)


def _request(cfg: LoadConfig, rec: StreamRecord):
    from specdec.client import build_request

    return build_request(rec.prompt, max_new_tokens=cfg.max_new_tokens, temperature=rec.temperature,
                         seed=rec.seed, ignore_eos=True, num_speculative_tokens=cfg.num_speculative_tokens)


async def _run_stream(stub, cfg: LoadConfig, rec: StreamRecord, metadata, deadline: float, on_tokens) -> None:
    import grpc

    start = time.perf_counter()
    last = None
    call = stub.Generate(_request(cfg, rec), timeout=max(0.1, deadline - time.monotonic()), metadata=metadata)
    try:
        if rec.cancel_after == 0:  # gone before the first message: the request may still be queued
            await asyncio.sleep(0.01)
            call.cancel()
            rec.status = "cancelled"
            return
        async for response in call:
            now = time.perf_counter()
            if rec.finish_reason:
                rec.messages_after_finish += 1
            n = len(response.token_ids)
            if n:
                rec.messages += 1
                if last is None:
                    rec.ttft = now - start
                else:
                    rec.gaps.append(now - last)
                    rec.gaps_per_token.append((now - last) / n)
                last = now
                rec.token_ids.extend(response.token_ids)
                on_tokens(n)
            if response.finish_reason:
                rec.finish_messages += 1
                rec.finish_reason = response.finish_reason
                rec.stats_generated = response.stats.generated_tokens
                rec.stats_prompt_tokens = response.stats.prompt_tokens
            if rec.cancel_after is not None and not rec.finish_reason and len(rec.token_ids) >= rec.cancel_after:
                call.cancel()
                rec.status = "cancelled"
                break
        if rec.status != "cancelled":
            rec.status = "completed"
    except asyncio.CancelledError:
        if rec.status != "cancelled":  # the run's hard timeout
            call.cancel()
            rec.status, rec.error = "failed", "cancelled by the load test's timeout"
            raise
    except grpc.RpcError as e:
        rec.status = "failed"
        rec.error = f"{e.code().name}: {e.details()}"


def _check_stream(cfg: LoadConfig, rec: StreamRecord) -> list[str]:
    problems = []
    n = len(rec.token_ids)
    if rec.messages_after_finish:
        problems.append(f"{rec.messages_after_finish} message(s) after the finish message")
    if rec.finish_messages > 1:
        problems.append(f"{rec.finish_messages} finish messages")
    if rec.status == "completed":
        if not rec.finish_reason:
            problems.append("the stream ended without a finish_reason")
        elif rec.finish_reason != "length":
            problems.append(f"finish_reason {rec.finish_reason!r}, expected 'length' (ignore_eos)")
        if n != cfg.max_new_tokens:
            problems.append(f"{n} tokens, expected exactly {cfg.max_new_tokens}")
        if rec.stats_generated is not None and rec.stats_generated != n:
            problems.append(f"the server counted {rec.stats_generated} generated tokens, the client {n}")
        if isinstance(rec.prompt, list) and rec.stats_prompt_tokens is not None \
                and rec.stats_prompt_tokens != len(rec.prompt):
            problems.append(f"the server saw a {rec.stats_prompt_tokens}-token prompt, the client sent "
                            f"{len(rec.prompt)} tokens (streams mixed up?)")
    elif rec.status == "cancelled":
        if n > cfg.max_new_tokens:
            problems.append(f"{n} tokens before the cancel, more than max_new_tokens={cfg.max_new_tokens}")
    elif rec.status == "failed":
        problems.append(f"failed: {rec.error}")
    else:
        problems.append("never finished (lost)")
    return [f"stream {rec.tag}: {p}" for p in problems]


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.done = 0
        self._last = 0.0

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and now - self._last > 0.2:
            self._last = now
            self.draw()

    def draw(self, end: bool = False) -> None:
        if not self.enabled:
            return
        if not self.total:  # duration mode: no end known in tokens
            sys.stderr.write(f"\r{self.done} tokens" + ("\n" if end else ""))
            sys.stderr.flush()
            return
        frac = min(1.0, self.done / self.total)
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} tokens ({frac:5.1%})" + ("\n" if end else ""))
        sys.stderr.flush()


async def _run_all(address: str, cfg: LoadConfig, records: list[StreamRecord]) -> float:
    import grpc

    from specdec.client import _MAX_MESSAGE_BYTES
    from specdec.v1 import generation_pb2_grpc

    metadata = (("authorization", f"Bearer {cfg.token}"),) if cfg.token else None
    options = [("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES)]
    progress = _Progress(0 if cfg.duration else cfg.streams * cfg.max_new_tokens, cfg.progress)
    deadline = time.monotonic() + cfg.timeout
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout=min(cfg.timeout, 30.0))
        except asyncio.TimeoutError:
            raise ConnectionError(f"server not reachable at {address}") from None
        stub = generation_pb2_grpc.GenerationStub(channel)
        t0 = time.perf_counter()
        if cfg.duration:
            run_id = uuid.uuid4().hex[:6]
            tasks = [asyncio.create_task(_run_client(stub, cfg, run_id, records, metadata, deadline, progress.add))
                     for _ in range(cfg.streams)]
        else:
            tasks = [asyncio.create_task(_run_stream(stub, cfg, r, metadata, deadline, progress.add)) for r in records]
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        wall = time.perf_counter() - t0
        progress.draw(end=True)
        if cfg.verify_sample:
            await _verify(stub, cfg, records, metadata, deadline)
    return wall


async def _run_client(stub, cfg: LoadConfig, run_id: str, records: list[StreamRecord], metadata,
                      deadline: float, on_tokens) -> None:
    """Duration mode: one client sending request after request until cfg.duration has passed."""
    end = time.monotonic() + cfg.duration
    while time.monotonic() < end:
        rec = _next_stream(cfg, run_id, len(records))
        records.append(rec)
        await _run_stream(stub, cfg, rec, metadata, deadline, on_tokens)


async def _verify(stub, cfg: LoadConfig, records: list[StreamRecord], metadata, deadline: float) -> None:
    """Replay some completed streams one at a time; their tokens must be the same."""
    import grpc

    done = [r for r in records if r.status == "completed" and len(r.token_ids) == cfg.max_new_tokens]
    for rec in random.Random(cfg.seed + 1).sample(done, min(cfg.verify_sample, len(done))):
        tokens: list[int] = []
        try:
            call = stub.Generate(_request(cfg, rec), timeout=max(0.1, deadline - time.monotonic()),
                                 metadata=metadata)
            async for response in call:
                tokens.extend(response.token_ids)
        except grpc.RpcError as e:
            rec.replay_error = f"replay failed: {e.code().name}: {e.details()}"
        else:
            if tokens != rec.token_ids:
                rec.replay_error = "replayed alone it produced other tokens (streams mixed up?)"
        rec.verified = True


def build_report(cfg: LoadConfig, records: list[StreamRecord], wall: float) -> LoadReport:
    failures: list[str] = []
    tags = [r.tag for r in records]
    if len(set(tags)) != len(tags):
        failures.append("duplicate stream tags")
    for rec in records:
        failures.extend(_check_stream(cfg, rec))
        if rec.replay_error:
            failures.append(f"stream {rec.tag}: {rec.replay_error}")
    count = {s: sum(r.status == s for r in records) for s in ("completed", "cancelled", "failed", "pending")}
    ttft = [r.ttft for r in records if r.ttft is not None]
    gaps = [g for r in records for g in r.gaps]
    gaps_tok = [g for r in records for g in r.gaps_per_token]
    generated = sum(len(r.token_ids) for r in records)
    if count["completed"] and not ttft:
        failures.append("no time to first token was measured")
    return LoadReport(
        streams=len(records), max_new_tokens=cfg.max_new_tokens, completed=count["completed"],
        cancelled=count["cancelled"], failed=count["failed"], missing=count["pending"],
        generated_tokens=generated, wall_seconds=wall,
        throughput_tokens_per_s=generated / wall if wall > 0 else 0.0,
        ttft_p50_ms=_ms(percentile(ttft, 50)), ttft_p99_ms=_ms(percentile(ttft, 99)),
        itl_message_p50_ms=_ms(percentile(gaps, 50)), itl_message_p99_ms=_ms(percentile(gaps, 99)),
        itl_token_p50_ms=_ms(percentile(gaps_tok, 50)), itl_token_p99_ms=_ms(percentile(gaps_tok, 99)),
        verified_streams=sum(r.verified and not r.replay_error for r in records),
        failures=failures)


def run_streams(address: str, cfg: LoadConfig) -> tuple[LoadReport, list[StreamRecord]]:
    """Run the load against a server at `address`; the report checks every stream (not the KV
    cache), the records hold what each stream received."""
    records = make_streams(cfg, uuid.uuid4().hex[:6]) if not cfg.duration else []
    wall = asyncio.run(_run_all(address, cfg, records))
    return build_report(cfg, records, wall), records


def run_load(address: str, cfg: LoadConfig) -> LoadReport:
    return run_streams(address, cfg)[0]


# --- embedded: a server of our own, so the KV cache can be checked -------------------------


class WireRecorder:
    """The server's on_round hook: bytes on the wire of every round, per worker (gRPC clients)."""

    def __init__(self, counters: dict):
        from coordinator.metrics import WireDeltas

        self._deltas = WireDeltas(counters)
        self._counters = counters
        self.rounds: list[dict] = []  # {"draft": sent+received, "target": ..., "sent", "received", "tokens"}

    def __call__(self, report) -> None:
        if not report.ran:
            return  # no round ran (nothing due); its bytes, if any, count towards the next round
        row = {"tokens": report.committed_tokens, "sent": 0, "received": 0}
        for worker, (sent, received) in self._deltas.take().items():
            row[worker] = sent + received
            row["sent"] += sent
            row["received"] += received
        self.rounds.append(row)

    def summary(self) -> dict | None:
        if not self.rounds:
            return None
        rows = self.rounds
        tokens = sum(r["tokens"] for r in rows)

        def stats(key):
            values = [float(r.get(key, 0)) for r in rows]
            return {"mean": sum(values) / len(values), "p99": percentile(values, 99), "total": int(sum(values))}

        per_round = [float(r["sent"] + r["received"]) for r in rows]
        total = sum(per_round)
        return {
            "rounds": len(rows),
            "generated_tokens": tokens,
            "bytes_per_round": {"mean": total / len(rows), "p99": percentile(per_round, 99), "total": int(total)},
            "sent_per_round": stats("sent"),
            "received_per_round": stats("received"),
            "draft_per_round": stats("draft"),
            "target_per_round": stats("target"),
            "bytes_per_token": total / tokens if tokens else None,
            "rpcs_per_worker": {worker: counter.rounds for worker, counter in self._counters.items()},
        }


def _caches(workers) -> dict:
    """The KV caches to audit: the target's, and the draft model's if there is one."""
    target_worker, draft_worker = workers
    caches = {"target": target_worker.cache}
    if draft_worker is not None and draft_worker.drafter.kv_cache is not None:
        caches["draft"] = draft_worker.drafter.kv_cache
    return caches


def run_embedded(config: ServiceConfig, load: LoadConfig, grpc_workers: bool = False,
                 settle_s: float = 10.0) -> LoadReport:
    """Start a server on 127.0.0.1:0 with in-process workers, run the load, then check that every
    KV block is free and the engine holds no request. `grpc_workers`: serve the workers over
    loopback gRPC and report bytes on the wire per round."""
    from coordinator.server_thread import LOOPBACK_SERVER, run_server_in_thread
    from draft_worker.worker import DraftWorker
    from specdec.app.embedded import GrpcSchedulerFactory, LocalSchedulerFactory
    from target_worker.worker import TargetWorker

    config = dataclasses.replace(config, server=dataclasses.replace(LOOPBACK_SERVER, grace_period=1.0))
    servers: list = []
    recorder = None
    if grpc_workers:
        from draft_worker import grpc_server as draft_server
        from target_worker import grpc_server as target_server

        workers = (TargetWorker.from_config(config.target), DraftWorker.from_config(config.draft))
        tserver, tport = target_server.serve(workers[0])
        servers.append(tserver)
        draft_address = None
        if workers[1] is not None:
            dserver, dport = draft_server.serve(workers[1])
            servers.append(dserver)
            draft_address = f"127.0.0.1:{dport}"
        factory = GrpcSchedulerFactory(config, f"127.0.0.1:{tport}", draft_address)
        recorder = WireRecorder(factory.wire)
    else:
        factory = LocalSchedulerFactory(config)
    if factory.tokenizer is None and not load.vocab_size:
        from specdec.model.source import resolve_model_source

        load.vocab_size = int(resolve_model_source(config.target.model).config["vocab_size"])
    try:
        with run_server_in_thread(factory, factory.tokenizer, config.server, on_round=recorder) as handle:
            if not grpc_workers:
                workers = (factory.target_worker, factory.draft_worker)
            report = run_load(f"127.0.0.1:{handle.port}", load)
            _settle(handle, workers, report, settle_s)
        _audit(workers, report)  # the scheduler thread has stopped: no race with it
    finally:
        factory.close()
        for server in servers:
            server.stop(None)
    if recorder is not None:
        report.wire = recorder.summary()
    return report


def _settle(handle, workers, report: LoadReport, settle_s: float) -> None:
    """Wait for the releases to reach the workers (on the scheduler's next pass)."""
    thread = handle.server.scheduler
    end = time.monotonic() + settle_s
    while time.monotonic() < end:
        sched = thread.scheduler
        idle = thread.num_active == 0 and not sched.running and not sched.waiting \
            and handle.server.gate.in_flight == 0
        if idle and not any(c.allocator.num_used for c in _caches(workers).values()):
            break
        time.sleep(0.01)
    sched = thread.scheduler
    if thread.num_active or sched.running or sched.waiting:
        report.failures.append(f"the engine still holds requests after the run: {thread.num_active} streams, "
                               f"{len(sched.running)} running, {len(sched.waiting)} waiting")


def _audit(workers, report: LoadReport) -> None:
    caches = _caches(workers)
    for name, cache in caches.items():
        try:
            cache.check_accounting()
        except Exception as e:  # noqa: BLE001 - reported as a failed check
            report.failures.append(f"{name} KV-cache accounting: {e}")
        if cache.allocator.num_used:
            report.failures.append(f"{cache.allocator.num_used} {name} KV blocks still in use after every "
                                   "stream ended")
    report.kv_blocks_used_target = caches["target"].allocator.num_used
    report.kv_blocks_used_draft = caches["draft"].allocator.num_used if "draft" in caches else None


# --- output --------------------------------------------------------------------------------


def format_report(r: LoadReport) -> str:
    def f(x, unit=""):
        return "n/a" if x is None else f"{x:.2f}{unit}"

    rows = [
        ("streams", f"{r.streams} x {r.max_new_tokens} tokens"),
        ("completed / cancelled / failed / missing", f"{r.completed} / {r.cancelled} / {r.failed} / {r.missing}"),
        ("generated tokens", str(r.generated_tokens)),
        ("wall time", f(r.wall_seconds, " s")),
        ("throughput", f(r.throughput_tokens_per_s, " tokens/s")),
        ("time to first token p50 / p99", f"{f(r.ttft_p50_ms)} / {f(r.ttft_p99_ms)} ms"),
        ("inter-token latency per message p50 / p99", f"{f(r.itl_message_p50_ms)} / {f(r.itl_message_p99_ms)} ms"),
        ("inter-token latency per token p50 / p99", f"{f(r.itl_token_p50_ms)} / {f(r.itl_token_p99_ms)} ms"),
        ("KV blocks used after (target / draft)",
         "n/a (remote server)" if r.kv_blocks_used_target is None and r.kv_blocks_used_draft is None
         else f"{r.kv_blocks_used_target} / {'n/a' if r.kv_blocks_used_draft is None else r.kv_blocks_used_draft}"),
        ("streams replayed alone and equal", str(r.verified_streams)),
        ("checks", "PASS" if r.ok else f"FAIL ({len(r.failures)})"),
    ]
    w = r.wire
    if w:
        def b(stats):
            return f"{stats['mean']:.0f} / {stats['p99']:.0f} B"

        per_token = "n/a" if w["bytes_per_token"] is None else f"{w['bytes_per_token']:.1f} B"
        rows[-1:-1] = [
            ("wire bytes per round, sent+received mean / p99", b(w["bytes_per_round"])),
            ("  draft worker mean / p99", b(w["draft_per_round"])),
            ("  target worker mean / p99", b(w["target_per_round"])),
            ("  sent / received mean", f"{w['sent_per_round']['mean']:.0f} / {w['received_per_round']['mean']:.0f} B"),
            ("wire bytes per generated token", per_token),
            ("wire rounds (RPCs draft / target)",
             f"{w['rounds']} ({w['rpcs_per_worker'].get('draft', 0)} / {w['rpcs_per_worker'].get('target', 0)})"),
        ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for failure in r.failures[:20]:
        lines.append(f"  - {failure}")
    if len(r.failures) > 20:
        lines.append(f"  ... and {len(r.failures) - 20} more")
    return "\n".join(lines)


# --- the subcommand ------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    parser.add_argument("--address", default="127.0.0.1:50051", help="server host:port (default %(default)s)")
    parser.add_argument("--token", default=None, help="bearer token for an authenticated server")
    parser.add_argument("--streams", type=int, default=64, help="concurrent Generate streams (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens per stream (default %(default)s)")
    parser.add_argument("--cancel-fraction", type=float, default=0.1,
                        help="fraction of streams cancelled after a random number of tokens, 0 to "
                             "max-new-tokens - 1 (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=None, help="unset or 0: greedy")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts, the cancel points and each stream")
    parser.add_argument("--num-speculative-tokens", type=int, default=None, help="K per request (default: server's)")
    parser.add_argument("--timeout", type=float, default=300.0, help="hard bound on the run, seconds")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="send random token-id prompts in [0, N) instead of text (servers without a tokenizer)")
    parser.add_argument("--verify-sample", type=int, default=0,
                        help="replay N completed streams one at a time and require the same tokens")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    e = parser.add_argument_group("embedded server (checks the KV cache after the run)")
    e.add_argument("--embedded", action="store_true", help="start a server on 127.0.0.1:0 in this process")
    e.add_argument("--grpc-workers", action="store_true",
                   help="serve the draft and target workers over loopback gRPC and report bytes on the wire per round")
    e.add_argument("-k", "--server-k", dest="server_num_speculative_tokens", type=int, default=None,
                   help="the server's num_speculative_tokens (default: the config's)")
    add_settings(e, EMBEDDED_SETTINGS)
    c = parser.add_argument_group("chaos (see specdec/app/chaos.py)")
    c.add_argument("--chaos", type=float, default=None, metavar="SECONDS",
                   help="run a local Ray deployment and SIGKILL a random worker every SECONDS during the load; "
                        "then replay every completed stream uninterrupted and count different outputs "
                        "(uses the embedded-server settings; streams alternate greedy / sampled)")
    c.add_argument("--replicas-sweep", type=lambda text: [int(x) for x in text.split(",")], default=None,
                   metavar="N1,N2,...", help="run the load against a local Ray deployment with each number of "
                                             "target replicas in turn and print throughput ratios and latency "
                                             "(see specdec/app/replica_sweep.py)")
    c.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                   help="closed loop: --streams clients each send request after request for SECONDS "
                        "(default with --chaos: 60)")


def load_from_args(args) -> LoadConfig:
    return LoadConfig(streams=args.streams, max_new_tokens=args.max_new_tokens, cancel_fraction=args.cancel_fraction,
                      temperature=args.temperature, seed=args.seed, timeout=args.timeout,
                      num_speculative_tokens=args.num_speculative_tokens, vocab_size=args.vocab_size,
                      verify_sample=args.verify_sample, progress=not args.no_progress and sys.stderr.isatty(),
                      token=args.token, duration=args.duration or (60.0 if args.chaos else None),
                      mixed=args.chaos is not None)


def _bad_args(args) -> str | None:
    if not 1 <= args.streams <= 10_000:
        return "--streams must be between 1 and 10000"
    if args.max_new_tokens < 1:
        return "--max-new-tokens must be >= 1"
    if not 0.0 <= args.cancel_fraction <= 1.0:
        return "--cancel-fraction must be in [0, 1]"
    if not args.timeout > 0:
        return "--timeout must be > 0"
    if args.grpc_workers and not args.embedded:
        return "--grpc-workers needs --embedded"
    if args.chaos is not None and (args.chaos <= 0 or args.embedded):
        return "--chaos needs a positive number of seconds, and runs its own deployment (no --embedded)"
    if args.replicas_sweep is not None and (args.embedded or args.chaos is not None
                                            or not all(n >= 1 for n in args.replicas_sweep)):
        return "--replicas-sweep takes positive counts and runs its own deployments (no --embedded, --chaos)"
    if args.duration is not None and args.duration <= 0:
        return "--duration must be > 0"
    if args.verify_sample < 0:
        return "--verify-sample must be >= 0"
    return None


def run(args: argparse.Namespace) -> int:
    problem = _bad_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    load = load_from_args(args)
    chaos = None
    try:
        if args.replicas_sweep is not None:
            from specdec.app.replica_sweep import format_sweep, run_replica_sweep

            config = ServiceConfig.from_settings(**given_settings(args, EMBEDDED_SETTINGS))
            results = run_replica_sweep(config, load, args.replicas_sweep)
            print(format_sweep(results))
            return 0 if all(r.ok for _, r in results) else 1
        if args.chaos is not None:
            from specdec.app.chaos import format_chaos, run_chaos

            load.timeout = max(load.timeout, load.duration + 300.0)  # the tail of the last streams
            config = ServiceConfig.from_settings(**given_settings(args, EMBEDDED_SETTINGS))
            report, chaos = run_chaos(config, load, args.chaos)
        elif args.embedded:
            server_k = {} if args.server_num_speculative_tokens is None else {
                "num_speculative_tokens": args.server_num_speculative_tokens}
            config = ServiceConfig.from_settings(**given_settings(args, EMBEDDED_SETTINGS), **server_k)
            report = run_embedded(config, load, grpc_workers=args.grpc_workers)
        else:
            report = run_load(args.address, load)
    except (ConnectionError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    if chaos is not None:
        print(format_chaos(chaos))
    if args.json:
        with open(args.json, "w") as fh:
            data = report.to_dict()
            if chaos is not None:
                data["chaos"] = {**dataclasses.asdict(chaos), "ok": chaos.ok}
            json.dump(data, fh, indent=2)
            fh.write("\n")
    return 0 if report.ok else 1
