"""A request's randomness as a pure function of (seed, absolute token position, purpose).

No generator advances with each draw: the uniform a request uses for one purpose at one position is
a counter-based hash of those three values. The same position of the same request therefore sees
the same uniforms whatever shares its batch, however many tokens a round proposed, whether a
proposal was drafted and thrown away, and which worker process computed it. That is what keeps a
seeded request reproducible under continuous batching, adaptive K, overlapped drafting and resume
after a worker restart (see DESIGN.md, "where a request's randomness lives").

A token tree (specdec.sampling.tree) has several nodes at one position: a node's rank among the
nodes of its depth picks its own stream (rank 0, a chain's only node, keeps the plain one).

Purposes, one independent stream each:
- DRAFT: the draft's sample of the token it proposes at `position`;
- ACCEPT: the target's accept test of the draft token at `position`;
- TARGET: the target's own sample at `position` (plain decoding, the residual after a rejection,
  the bonus token).

The hash is SplitMix64 (Steele, Lea and Flood 2014): the stream key is mix64(seed ^ salt(purpose))
and the value at `position` is mix64(key + (position + 1) * GAMMA), i.e. element `position` of
the SplitMix64 sequence seeded with that key. Every 64-bit seed gives its own streams (mix64 is a
bijection on 64-bit words). A uniform keeps the top 53 bits: float64 on a 2^-53 grid. float32
uniforms would put inverse-CDF sampling on a 2^-24 grid, where tokens of probability below 2^-24
(tens of thousands of them in a 150k vocabulary) could never be drawn.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

DRAFT, ACCEPT, TARGET = "draft", "accept", "target"
SEED_LIMIT = 1 << 64  # seeds are unsigned 64-bit integers

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_SALT = {DRAFT: np.uint64(0x243F6A8885A308D3), ACCEPT: np.uint64(0x13198A2E03707344),
         TARGET: np.uint64(0xA4093822299F31D0)}  # digits of pi: no structure shared with GAMMA


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on uint64 words (wrapping arithmetic), a bijection."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def random_seed() -> int:
    """A fresh seed from the OS, for requests that did not bring one."""
    return int.from_bytes(os.urandom(8), "little")


def uniforms(seeds: Sequence[int], positions: np.ndarray | Sequence, purpose: str,
             device: torch.device | str | None = None, ranks: Sequence[int] | None = None) -> torch.Tensor:
    """Uniforms in [0, 1) as float64: row r at positions[r] for request seed seeds[r], made on
    `device` (default the CPU; elsewhere by the same hash in torch, bit for bit: no copy per call).

    positions: [N] or [N, M] absolute token positions (the index of the token in prompt + output)
    -> a tensor of the same shape. ranks: [N] each row's tree rank (None: all 0).
    """
    pos = np.asarray(positions, dtype=np.int64)
    if pos.size and pos.min() < 0:
        raise ValueError("token positions are >= 0")
    on_cpu = device is None or torch.device(device).type == "cpu"
    if on_cpu and pos.size <= _FEW:
        return _few_uniforms(seeds, pos, purpose, ranks)
    streams = np.asarray([int(s) for s in seeds], dtype=np.uint64) ^ _SALT[purpose]
    if ranks is not None:  # mix64(0) = 0: rank 0 is the plain stream
        streams = streams ^ mix64(np.asarray(ranks, dtype=np.uint64) * _GAMMA)
    keys = mix64(streams)
    keys = keys.reshape((len(keys),) + (1,) * (pos.ndim - 1))
    if not on_cpu:
        return _device_uniforms(keys, pos, torch.device(device))
    words = mix64(keys + (pos.astype(np.uint64) + np.uint64(1)) * _GAMMA)
    return torch.from_numpy((words >> np.uint64(11)).astype(np.float64) * 2.0 ** -53)


_FEW = 16  # up to this many uniforms, Python's integers beat numpy's ~25 calls on tiny arrays
_MASK = (1 << 64) - 1


def _mix64_word(x: int) -> int:
    """mix64 on one word as a Python integer (wrapping made explicit)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def stream_key(seed: int, purpose: str, rank: int = 0) -> int:
    """The key of a request's stream for `purpose` (and tree rank) as a Python integer: its
    uniform at `position` is mix64(key + (position + 1) * GAMMA) >> 11, times 2^-53 (the C
    kernels' draft chain computes it from this key)."""
    stream = int(seed) ^ int(_SALT[purpose])
    if rank:
        stream ^= _mix64_word((int(rank) * int(_GAMMA)) & _MASK)
    return _mix64_word(stream)


def _few_uniforms(seeds: Sequence[int], pos: np.ndarray, purpose: str, ranks: Sequence[int] | None) -> torch.Tensor:
    """uniforms() on the CPU for a few values, in Python's integers: the same bits as numpy's
    (a batch-1 step asks for 1-12 values; numpy's fixed cost per call was ~30 us)."""
    gamma = int(_GAMMA)
    rows = pos.reshape(len(seeds), -1).tolist() if pos.size else []
    values = []
    for r, (seed, row) in enumerate(zip(seeds, rows)):
        key = stream_key(seed, purpose, 0 if ranks is None else ranks[r])
        values += [(_mix64_word((key + (p + 1) * gamma) & _MASK) >> 11) * 2.0 ** -53 for p in row]
    return torch.from_numpy(np.array(values, dtype=np.float64).reshape(pos.shape))


def _as_int64(words: np.ndarray) -> np.ndarray:
    return words.astype(np.uint64).view(np.int64)


def _lsr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 words holding uint64 bits (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _device_uniforms(keys: np.ndarray, pos: np.ndarray, device: torch.device) -> torch.Tensor:
    """The hash's last mix64 and the 53-bit scaling in torch on `device`: int64 arithmetic wraps
    as uint64's does, so the bits are numpy's (tests compare them)."""
    def signed(word: int) -> int:
        return int(np.array(word, dtype=np.uint64).view(np.int64))

    key = torch.from_numpy(_as_int64(keys)).to(device, non_blocking=True)
    x = key + (torch.from_numpy(pos).to(device, non_blocking=True) + 1) * signed(_GAMMA)
    x = (x ^ _lsr(x, 30)) * signed(0xBF58476D1CE4E5B9)
    x = (x ^ _lsr(x, 27)) * signed(0x94D049BB133111EB)
    x = x ^ _lsr(x, 31)
    return _lsr(x, 11).double() * 2.0 ** -53
