"""The load test's plan and verdict: the load asked for (`LoadConfig`), each stream's prompt, seed
and cancel point (a function of the seed and the stream's index only, so a stream can be replayed
elsewhere), what each stream received (`StreamRecord`), the checks every stream must pass, and the
report (`LoadReport`, `format_report`).
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field

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


# --- each stream's prompt, seed and cancel point -------------------------------------------


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


def next_stream(cfg: LoadConfig, run_id: str, i: int) -> StreamRecord:
    """Duration mode: stream i, cancelled mid-way with probability cancel_fraction."""
    rng = random.Random(cfg.seed * 7_919 + i)
    cancel = rng.random() < cfg.cancel_fraction
    return stream_record(cfg, run_id, i, rng.randint(0, cfg.max_new_tokens - 1) if cancel else None)



# --- the checks and the report ----------------------------------------------------------------


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

