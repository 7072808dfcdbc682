"""How many KV-cache blocks a worker takes on an accelerator, so that memory cannot run out.

Terms (bytes):
  total     the device's memory; free: what is free on it now (other processes included)
  share     the worker's kv_memory_fraction: the part of `total` it may hold, weights, activations
            and cache together, so two workers on one GPU each keep to their own part
  weights   the worker's weight tensors
  headroom  the activation peak of the largest pass the worker runs, measured: a prefill chunk
            (prefill_chunk_tokens new tokens, the most a pass takes) at two contexts, 0 and one
            chunk, extrapolated linearly to the longest context (torch's attention path keeps
            scores that grow with it; Triton's, on a GPU, keeps none: the slope is then ~0)
  blocks  = min(share * total - weights, free) - headroom, in blocks of bytes_per_block

A verify or decode pass of B * (K + 1) <= prefill_chunk_tokens tokens needs less than the chunk.
"""
from __future__ import annotations

from typing import Protocol

import torch

from specdec.kv_cache import blocks_for_tokens
from specdec.model.batch import prepare_forward
from specdec.model.decoder import Model

_PROBE = "memory-probe"


class DeviceMemory(Protocol):
    """What the sizing reads from the device (torch.cuda on a GPU; a fake in tests)."""

    def free_and_total(self) -> tuple[int, int]: ...
    def reset_peak(self) -> None: ...
    def allocated(self) -> int: ...
    def peak(self) -> int: ...


class CudaMemory:
    def __init__(self, device: torch.device):
        self.device = device

    def free_and_total(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


def bytes_per_block(model: Model, block_size: int) -> int:
    """Memory of one KV-cache block: keys and values of `block_size` tokens in every layer."""
    c = model.config
    return (2 * c.num_hidden_layers * block_size * c.num_key_value_heads * c.head_dim
            * model.kv_dtype.itemsize)


def pass_peak(model: Model, memory: DeviceMemory, block_size: int, context: int, tokens: int) -> int:
    """Bytes a pass of `tokens` new tokens after `context` cached ones allocates beyond its cache.
    The probe cache is freed after; its contents are never read for anything but the peak."""
    cache = model.new_kv_cache(blocks_for_tokens(context + tokens, block_size), block_size)
    cache.add_sequence(_PROBE)
    cache.append_slots(_PROBE, context)
    batch = prepare_forward(cache, [_PROBE], [[0] * tokens], [1])
    memory.reset_peak()
    before = memory.allocated()
    model.forward(batch, cache)
    peak = memory.peak() - before
    del cache, batch
    return peak


def activation_headroom(model: Model, memory: DeviceMemory, block_size: int, chunk_tokens: int) -> int:
    """The measured peak of a full prefill chunk, extrapolated to the model's longest context."""
    chunk = min(chunk_tokens, model.config.max_position_embeddings // 2)
    at_start = pass_peak(model, memory, block_size, 0, chunk)
    after_chunk = pass_peak(model, memory, block_size, chunk, chunk)
    per_context_token = max(0, after_chunk - at_start) / chunk
    return int(at_start + per_context_token * (model.config.max_position_embeddings - chunk))


def accelerator_num_blocks(model: Model, memory: DeviceMemory, block_size: int, share: float,
                           chunk_tokens: int, where: str = "kv_memory_fraction",
                           headroom: int | None = None, reserved: int = 0) -> int:
    """KV-cache blocks that fit this worker's share of the device after its weights, measured
    headroom (`headroom`: measured already by the caller) and `reserved` bytes (what the worker
    keeps besides: CUDA graphs' logits), never more than is free now. `where` names the setting in
    the error."""
    weight_bytes = model.num_parameters * model.dtype.itemsize
    if headroom is None:
        headroom = activation_headroom(model, memory, block_size, chunk_tokens)
    free, total = memory.free_and_total()
    budget = min(int(share * total) - weight_bytes, free) - headroom - reserved
    blocks = budget // bytes_per_block(model, block_size)
    if blocks < 1:
        gib = 1 << 30
        raise MemoryError(
            f"no room for a KV cache: {where}={share} of {total / gib:.1f} GiB, less the weights "
            f"({weight_bytes / gib:.2f} GiB), the measured activation headroom ({headroom / gib:.2f} GiB, "
            f"from prefill_chunk_tokens={chunk_tokens}) and the CUDA graphs' logits ({reserved / gib:.2f} GiB), "
            f"with {free / gib:.1f} GiB free; raise {where}, "
            "lower prefill_chunk_tokens, or set kv_cache_blocks")
    return int(blocks)
