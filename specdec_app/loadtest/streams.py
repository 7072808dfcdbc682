"""Running the load: N concurrent Generate streams over grpc.aio against a server's address, each
timed message by message and cancelled at its cancel point; in duration mode, closed-loop clients
sending request after request; with verify_sample, some completed streams replayed alone.
"""
from __future__ import annotations

import asyncio
import random
import sys
import time
import uuid

import grpc

from specdec.client import _MAX_MESSAGE_BYTES, build_request
from specdec.v1 import generation_pb2_grpc
from specdec_app.loadtest.records import LoadConfig, LoadReport, StreamRecord, build_report, make_streams, next_stream


def _request(cfg: LoadConfig, rec: StreamRecord):
    return build_request(rec.prompt, max_new_tokens=cfg.max_new_tokens, temperature=rec.temperature,
                         seed=rec.seed, ignore_eos=True, num_speculative_tokens=cfg.num_speculative_tokens)


async def _run_stream(stub, cfg: LoadConfig, rec: StreamRecord, metadata, deadline: float, on_tokens) -> None:
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
        rec = next_stream(cfg, run_id, len(records))
        records.append(rec)
        await _run_stream(stub, cfg, rec, metadata, deadline, on_tokens)


async def _verify(stub, cfg: LoadConfig, records: list[StreamRecord], metadata, deadline: float) -> None:
    """Replay some completed streams one at a time; their tokens must be the same."""
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



def run_streams(address: str, cfg: LoadConfig) -> tuple[LoadReport, list[StreamRecord]]:
    """Run the load against a server at `address`; the report checks every stream (not the KV
    cache), the records hold what each stream received."""
    records = make_streams(cfg, uuid.uuid4().hex[:6]) if not cfg.duration else []
    wall = asyncio.run(_run_all(address, cfg, records))
    return build_report(cfg, records, wall), records


def run_load(address: str, cfg: LoadConfig) -> LoadReport:
    return run_streams(address, cfg)[0]

