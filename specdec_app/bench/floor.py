"""The physical floor of a batch-1 decode step, and timing of decode steps against it.

At batch 1 a decode step reads every weight matrix once to produce one token: it is bound by memory
bandwidth, not arithmetic. Its floor is the bytes of weights a step reads divided by the bandwidth
one large matrix-vector product reaches on this machine, measured in the same run (a [576 x 49152]
float32 matrix, SmolLM2-135M's LM head: 113 MB, far larger than any CPU cache, so it streams from
memory as a model's weights do).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from specdec.model.decoder import Model
from specdec.model.runner import ModelRunner

MATVEC_SHAPE = (576, 49152)  # [in, out] of the bandwidth probe


def decode_weight_bytes(model: Model) -> int:
    """Bytes of weights one decode step reads: every projection (as held: floats, or codes with
    their scales), the LM head and the norms (the embedding contributes one row per token: nothing
    next to the rest)."""
    w = model.weights

    def held(projection) -> int:
        if projection.weight is None:
            return projection.panels.nbytes
        bias = 0 if projection.bias is None else projection.bias.numel() * projection.bias.element_size()
        return projection.weight.numel() * projection.weight.element_size() + bias

    norms = [w.final_norm] + [t for layer in w.layers for t in (layer.input_norm, layer.post_norm, layer.qk_norm)
                              if t is not None]
    return (held(w.lm_head) + sum(held(p) for layer in w.layers for p in layer.projections())
            + sum(t.numel() * t.element_size() for t in norms))


class MatvecProbe:
    """One large float32 matrix-vector product, timed one call at a time (x @ W, W [in, out])."""

    def __init__(self, shape: tuple[int, int] = MATVEC_SHAPE):
        generator = torch.Generator().manual_seed(0)
        self.weight = torch.randn(shape, generator=generator)
        self.x = torch.randn(1, shape[0], generator=generator)
        self.bytes = self.weight.numel() * self.weight.element_size()
        self.x @ self.weight  # first touch: page faults are not bandwidth

    def time_once(self) -> float:
        start = time.perf_counter()
        self.x @ self.weight
        return time.perf_counter() - start


@dataclass
class StepTiming:
    batch: int
    context_len: int
    step_s: float  # median seconds of one decode step (one new token for each of `batch` sequences)
    min_step_s: float
    bandwidth: float  # bytes/s of the probe, median over the calls interleaved with the steps
    weight_bytes: int

    @property
    def floor_s(self) -> float:
        return self.weight_bytes / self.bandwidth

    @property
    def over_floor(self) -> float:
        return self.step_s / self.floor_s


def time_decode_steps(runner: ModelRunner, context: list[int], batch: int, steps: int,
                      probe: MatvecProbe) -> StepTiming:
    """Decode steps of `batch` copies of `context` (prefilled once; the cache rolls back after each
    step so the context stays fixed), each followed by one probe call: step and bandwidth see the
    same machine state, which matters on a shared machine."""
    ids = [f"floor-{i}" for i in range(batch)]
    cache = runner.cache
    for seq_id in ids:
        cache.add_sequence(seq_id)
    try:
        runner.run(ids, [list(context)] * batch, [1] * batch)
        length = cache.length(ids[0])
        step_times, probe_times = [], []
        for step in range(steps + 2):  # the first two warm up the allocator and caches
            start = time.perf_counter()
            runner.run(ids, [[context[-1]]] * batch, [1] * batch)
            elapsed = time.perf_counter() - start
            for seq_id in ids:
                cache.truncate_to(seq_id, length)
            probe_elapsed = probe.time_once()
            if step >= 2:
                step_times.append(elapsed)
                probe_times.append(probe_elapsed)
    finally:
        for seq_id in ids:
            cache.free_sequence(seq_id)
    return StepTiming(batch=batch, context_len=len(context) + 1, step_s=statistics.median(step_times),
                      min_step_s=min(step_times), bandwidth=probe.bytes / statistics.median(probe_times),
                      weight_bytes=decode_weight_bytes(runner.model))
