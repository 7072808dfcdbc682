"""Per-request randomness.

Every request owns a generator and every uniform it consumes is drawn from that generator, in
request order. A seeded request therefore sees the same stream of uniforms whatever else is in
the batch, which is what makes `seed` reproducible under continuous batching.
"""
from __future__ import annotations

import os

import torch


def make_generator(seed: int | None, device="cpu") -> torch.Generator:
    """A generator seeded with `seed`, or with fresh OS entropy when seed is None."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def draw_uniforms(generators: list[torch.Generator], n: int, device="cpu") -> torch.Tensor:
    """[len(generators), n] float32 in [0, 1); row r comes only from generators[r]."""
    if not generators:
        return torch.zeros(0, n, dtype=torch.float32, device=device)
    rows = [torch.rand(n, generator=g, device=g.device, dtype=torch.float32) for g in generators]
    return torch.stack([r.to(device) for r in rows])
