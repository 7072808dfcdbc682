"""Attention over the paged KV cache in Triton kernels (the GPU's path; the CPU keeps
model.attention's torch path and the C kernels). Imported only where Triton runs (decoder).

Terms: a pass feeds T new tokens of B sequences; sequence b's tokens are rows
query_start[b] .. query_start[b+1] - 1 of q, and after the pass it holds seq_lens[b] keys, key n of
it at flat cache slot block_tables[b, n // bs] * bs + n % bs. The token at absolute position p
sees keys 0..p of its own sequence: that one rule is causality within the new tokens and the
boundary of each sequence, so no mask tensor exists and no memory grows with the prompt.

One program serves one sequence, one KV head, a tile of BLOCK_M (token, query head) rows and one
*split* of the keys: the query heads sharing a KV head (GQA) are rows of one tile, so each key
block is loaded once for the group. Keys are read straight from their pages (no gathered copy),
in blocks of BLOCK_N with an online softmax in float32, up to the tile's last position (causal
blocks and tiles past a sequence's tokens cost nothing). A decode step has one tile per sequence
and KV head: 8 programs for a batch-1 step of a Llama-3.2 model, on a GPU of 132 multiprocessors,
each walking the whole context. So small passes split the keys in `splits` equal parts (a power
of two, chosen from the grid's size alone), each program keeps its part's running max, sum and
unnormalised output, and a second kernel merges the parts (flash-decoding). Shapes depend only on
the batch size and the largest query length; lengths are read from device memory, which lets a
CUDA graph replay a captured pass at any context length (model.cuda_graphs).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N = 32, 64
MAX_SPLITS = 16
# Triton's CPU interpreter (tests) multiplies bfloat16 tiles wrongly (numpy has no bfloat16), so
# there the products run in float32 (exact for bfloat16 inputs); a GPU multiplies half precision
# on its tensor cores, accumulating in float32.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_max_ptr, part_sum_ptr, block_tables_ptr,
                            seq_lens_ptr, query_start_ptr, positions_ptr, q_stride_t, q_stride_h, table_stride,
                            scale_log2, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                            SPLITS: tl.constexpr, FP32_DOT: tl.constexpr):
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    tile, split = tl.program_id(2) // SPLITS, tl.program_id(2) % SPLITS
    group: tl.constexpr = H // HKV
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # row r: token r // group, head r % group
    token = rows // group
    row_ok = token < q_len
    head = kv_head * group + rows % group
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    row_d_ok = row_ok[:, None] & d_ok[None, :]
    q_offsets = ((q_start + token) * q_stride_t + head * q_stride_h)[:, None] + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_d_ok, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    position = tl.load(positions_ptr + q_start + token, mask=row_ok, other=-1)
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N  # keys per split
    first = split * chunk
    end = tl.minimum(tl.minimum(first + chunk, seq_len), tl.max(position, 0) + 1)  # none past the tile
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(first, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < end
        page = tl.load(block_tables_ptr + seq * table_stride + n // BS, mask=n_ok, other=0)
        kv_offsets = ((page * BS + n % BS) * HKV + kv_head)[:, None] * D + d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if FP32_DOT:
            k, v = k.to(tl.float32), v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where((n[None, :] <= position[:, None]) & n_ok[None, :], scores * scale_log2, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows that saw no key yet
        p = tl.math.exp2(scores - safe_max[:, None])
        correction = tl.math.exp2(running_max - safe_max)
        running_sum = running_sum * correction + tl.sum(p, 1)
        if FP32_DOT:
            acc = acc * correction[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v)
        running_max = new_max
    out_rows = (q_start + token) * H + head
    if SPLITS == 1:
        out = acc / tl.where(row_ok, running_sum, 1.0)[:, None]
        tl.store(out_ptr + out_rows[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_d_ok)
    else:  # this split's part, merged by _merge_splits_kernel
        part_rows = out_rows * SPLITS + split
        tl.store(out_ptr + part_rows[:, None] * D + d[None, :], acc, mask=row_d_ok)
        tl.store(part_max_ptr + part_rows, running_max, mask=row_ok)
        tl.store(part_sum_ptr + part_rows, running_sum, mask=row_ok)

@triton.jit
def _merge_splits_kernel(part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, D: tl.constexpr,
                         BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # a (token, head) pair
    parts = row * SPLITS + tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    part_max = tl.load(part_max_ptr + parts)
    weight = tl.math.exp2(part_max - tl.max(part_max, 0))  # 0 for a split that saw no key
    total = tl.sum(tl.load(part_sum_ptr + parts) * weight, 0)
    acc = tl.load(part_out_ptr + parts[:, None] * D + d[None, :], mask=(d < D)[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / total
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessor count (4 for the interpreter's CPU)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def attention_splits(programs: int, multiprocessors: int) -> int:
    """Key splits for a grid of `programs` (sequence, KV head, tile) programs: enough to give every
    multiprocessor two, at most MAX_SPLITS, a power of two (1 where the grid fills the GPU)."""
    splits = 1
    while splits < MAX_SPLITS and programs * splits < 2 * multiprocessors:
        splits *= 2
    return splits


def triton_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                           positions: torch.Tensor, max_query_len: int, scale: float,
                           splits: int | None = None) -> torch.Tensor:
    """q: [T, H, D] (rotated; any strides, D contiguous); k_cache, v_cache: [blocks, bs, Hkv, D]
    (this pass's keys already written); block_tables: [B, max_blocks]; seq_lens: [B];
    query_start: [B + 1]; positions: [T]; max_query_len: the most new tokens any sequence has;
    splits: key splits (default: attention_splits for this grid on this device).
    Returns [T, H, D] in q's dtype."""
    tokens, heads, dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    q = q if q.stride(2) == 1 else q.contiguous()
    tiles = triton.cdiv(max_query_len * (heads // kv_heads), BLOCK_M)
    if splits is None:
        splits = attention_splits(block_tables.shape[0] * kv_heads * tiles, multiprocessors(q.device))
    out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    block_d = max(16, triton.next_power_of_2(dim))
    parts = (out, out, out)  # with one split the kernel writes the output itself
    if splits > 1:  # each split's unnormalised output, running max and sum, per (token, head)
        parts = (torch.empty(tokens * heads * splits, dim, dtype=torch.float32, device=q.device),
                 torch.empty(tokens * heads * splits, dtype=torch.float32, device=q.device),
                 torch.empty(tokens * heads * splits, dtype=torch.float32, device=q.device))
    _paged_attention_kernel[(block_tables.shape[0], kv_heads, tiles * splits)](
        q, k_cache, v_cache, parts[0], parts[1], parts[2], block_tables, seq_lens, query_start, positions,
        q.stride(0), q.stride(1), block_tables.stride(0), scale * 1.4426950408889634, H=heads, HKV=kv_heads, D=dim,
        BS=block_size, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=block_d, SPLITS=splits,
        FP32_DOT=q.dtype == torch.float32 or INTERPRETED)
    if splits > 1:
        _merge_splits_kernel[(tokens * heads,)](*parts, out, D=dim, BLOCK_D=block_d, SPLITS=splits)
    return out
