"""Products by weights held as codes on a GPU: one Triton kernel that streams the codes and never
widens the matrix to floats in memory (the GPU's side of model.quantized; the CPU's is
cpu_kernels.c).

Terms. A group is GROUP consecutive inputs of one output sharing a float16 scale s and, for q4, a
minimum m: w = s * code + m (model.quantized). For a row x the product is, group by group,
    y[n] = sum_g ( s[g, n] * sum_{k in g} x[k] code[k, n]  +  m[g, n] * sum_{k in g} x[k] ),
so the kernel multiplies x by the codes themselves (integers up to 255: exact in bfloat16), and
applies each group's scale and minimum to the group's float32 sum. No weight is rounded to the
activations' dtype on the way, unlike a kernel that dequantizes into it.

Layout (made once at load, `DeviceCodes`): codes [in, out], so a tile's loads run along the
outputs; q8 one int8 per code; q4 two codes a byte, in GGUF's order within a group (byte i holds
code i in its low nibble and code i + 16 in its high one); scales and minimums [in / GROUP, out]
float16, the checkpoint's numbers bit for bit.

Batch invariance: a product of at most SMALL_ROWS rows (decode steps, verify passes) runs one
configuration whatever its row count, and its splits of the inputs depend on the matrix and the
GPU only, so a row's result does not depend on its batch mates or on how many tokens the pass
verifies. Larger passes (prefill chunks) take taller tiles.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specdec.model.quantized import GROUP, QuantizedMatrix
from specdec.model.triton_attention import INTERPRETED, multiprocessors

SMALL_ROWS = 64  # passes of up to this many rows run the batch-invariant configuration
MIN_GROUPS_PER_SPLIT = 8  # a split of the inputs streams at least this many groups


@dataclass(frozen=True)
class Launch:
    """How the product's kernel runs for one format: outputs per program, groups loaded per loop
    step (unrolled: more bytes in flight), warps and software-pipelining stages."""

    block_n: int
    step_groups: int
    num_warps: int
    num_stages: int


# Chosen by scripts/gpu_kernel_bench.py --only quantized on an H200: per format, the least time
# of a 3B target step's products at one row (docs/gpu-2026-11-27.md). q4 unpacks two codes a
# byte, and did best with twice the warps on half the outputs.
LAUNCH = {8: Launch(block_n=256, step_groups=2, num_warps=4, num_stages=3),
          4: Launch(block_n=128, step_groups=4, num_warps=8, num_stages=3)}


@triton.jit
def _quantized_product_kernel(x_ptr, codes_ptr, scales_ptr, mins_ptr, bias_ptr, out_ptr, rows, outputs, groups,
                              groups_per_split, x_stride, FOUR_BITS: tl.constexpr, HAS_MINS: tl.constexpr,
                              HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, FP32_DOT: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEP_GROUPS: tl.constexpr):
    n_block, split, m_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = (m_block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # (offsets past 2^31: a 256k vocabulary)
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    i = tl.arange(0, 16)  # a half group: codes i and i + 16 of each group (GROUP = 32)
    m_ok, n_ok = m < rows, n < outputs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * groups_per_split
    for step in range(first, tl.minimum(first + groups_per_split, groups), STEP_GROUPS):
        for j in tl.static_range(STEP_GROUPS):  # unrolled: the step's loads are all issued together
            g = step + j
            k = (g * 32 + i).to(tl.int64)
            k_ok = k < groups * 32  # (a last step past the matrix's groups adds zeros)
            x_ok = m_ok[:, None] & k_ok[None, :]
            x_lo = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=x_ok, other=0.0)
            x_hi = tl.load(x_ptr + m[:, None] * x_stride + (k + 16)[None, :], mask=x_ok, other=0.0)
            c_ok = k_ok[:, None] & n_ok[None, :]
            if FOUR_BITS:
                byte = tl.load(codes_ptr + (k - g * 16)[:, None] * outputs + n[None, :],  # byte row g * 16 + i
                               mask=c_ok, other=0)
                c_lo, c_hi = byte & 15, byte >> 4
            else:
                c_lo = tl.load(codes_ptr + k[:, None] * outputs + n[None, :], mask=c_ok, other=0)
                c_hi = tl.load(codes_ptr + (k + 16)[:, None] * outputs + n[None, :], mask=c_ok, other=0)
            if FP32_DOT:
                part = tl.dot(x_lo.to(tl.float32), c_lo.to(tl.float32), input_precision="ieee")
                part += tl.dot(x_hi.to(tl.float32), c_hi.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(x_lo, c_lo.to(x_lo.dtype)) + tl.dot(x_hi, c_hi.to(x_hi.dtype))
            g_ok = n_ok & (n * 0 + g < groups)  # (a vector: the interpreter masks by vectors)
            scale = tl.load(scales_ptr + g * outputs + n, mask=g_ok, other=0.0).to(tl.float32)
            acc += part * scale[None, :]
            if HAS_MINS:
                x_sum = tl.sum(x_lo.to(tl.float32), 1) + tl.sum(x_hi.to(tl.float32), 1)
                mins = tl.load(mins_ptr + g * outputs + n, mask=g_ok, other=0.0).to(tl.float32)
                acc += x_sum[:, None] * mins[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if DIRECT:  # one split: the output itself
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m[:, None] * outputs + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:  # this split's part, added up by _sum_splits_kernel
        tl.store(out_ptr + ((split * rows + m) * outputs)[:, None] + n[None, :], acc, mask=ok)


@triton.jit
def _sum_splits_kernel(parts_ptr, bias_ptr, out_ptr, size, outputs, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLITS):  # in split order: the same sum for any row count
        acc += tl.load(parts_ptr + split * size + offsets, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offsets % outputs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=ok)


@dataclass
class DeviceCodes:
    """A projection's weight [in, out] as codes in the layout above, on the GPU.
    codes: [in, out] int8 (q8) or [in / 2, out] uint8 (q4); scales, mins: [in / GROUP, out]
    float16 (mins None for q8); bias: [out] in `dtype` or None; dtype: the activations'.
    launch: the kernel's settings for this format when built (LAUNCH); splits: how many parts the
    inputs of a small pass are split into, and groups per part (whole steps of that launch)."""

    bits: int
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bias: torch.Tensor | None
    dtype: torch.dtype
    launch: Launch
    splits: tuple[int, int]

    @classmethod
    def build(cls, matrix: QuantizedMatrix, bias: torch.Tensor | None, device: torch.device | str,
              dtype: torch.dtype) -> DeviceCodes:
        """`matrix` [out, in] (model.quantized's layout) moved to `device` in the kernel's layout."""
        out, inputs = matrix.shape
        codes = matrix.codes.t()  # [in, out]
        if matrix.bits == 4:  # byte i of a group: code i (low nibble), code i + 16 (high nibble)
            halves = codes.to(torch.int16).reshape(inputs // GROUP, 2, GROUP // 2, out)
            codes = (halves[:, 0] | (halves[:, 1] << 4)).to(torch.uint8).reshape(inputs // 2, out)
        groups = inputs // GROUP
        device = torch.device(device)
        launch = LAUNCH[matrix.bits]
        programs = triton.cdiv(out, launch.block_n)
        splits = min(triton.cdiv(2 * multiprocessors(device), programs), max(1, groups // MIN_GROUPS_PER_SPLIT))
        per_split = triton.cdiv(triton.cdiv(groups, splits), launch.step_groups) * launch.step_groups  # whole steps

        def on_device(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=dtype).contiguous()

        return cls(matrix.bits, on_device(codes, codes.dtype), on_device(matrix.scales.t(), torch.float16),
                   on_device(None if matrix.mins is None else matrix.mins.t(), torch.float16), on_device(bias, dtype),
                   dtype, launch, (triton.cdiv(groups, per_split), per_split))

    @property
    def in_features(self) -> int:
        return self.scales.shape[0] * GROUP

    @property
    def out_features(self) -> int:
        return self.codes.shape[1]

    def columns(self, index: torch.Tensor) -> torch.Tensor:
        """Columns `index` [T] of the weight as rows [T, in] in `dtype` (a tied or quantized
        embedding's rows)."""
        codes = self.codes.index_select(1, index).to(torch.int16)  # [in or in / 2, T]
        if self.bits == 4:
            halves = codes.reshape(-1, 1, GROUP // 2, index.shape[0])
            codes = torch.cat([halves & 15, halves >> 4], dim=1).reshape(self.in_features, -1)
        rows = codes.float() * self.scales.index_select(1, index).float().repeat_interleave(GROUP, dim=0)
        if self.mins is not None:
            rows += self.mins.index_select(1, index).float().repeat_interleave(GROUP, dim=0)
        return rows.t().to(self.dtype).contiguous()  # (a pass adds to its rows in place)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins, self.bias)
                   if t is not None)


def quantized_product(x: torch.Tensor, weight: DeviceCodes) -> torch.Tensor:
    """x: [M, in] -> x @ w + bias: [M, out] in x's dtype, w being the codes' matrix."""
    rows, outputs = x.shape[0], weight.out_features
    out = torch.empty(rows, outputs, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    groups = weight.scales.shape[0]
    small = rows <= SMALL_ROWS
    splits, per_split = weight.splits if small else (1, groups)
    parts = out if splits == 1 else torch.empty(splits, rows, outputs, dtype=torch.float32, device=x.device)
    block_m = 16 if small else 64
    absent = weight.scales  # a pointer for the kernel's unused arguments
    bias = absent if weight.bias is None else weight.bias
    launch = weight.launch  # (the one its splits were cut for)
    _quantized_product_kernel[(triton.cdiv(outputs, launch.block_n), splits, triton.cdiv(rows, block_m))](
        x, weight.codes, weight.scales, absent if weight.mins is None else weight.mins, bias, parts, rows, outputs,
        groups, per_split, x.stride(0), FOUR_BITS=weight.bits == 4, HAS_MINS=weight.mins is not None,
        HAS_BIAS=weight.bias is not None, DIRECT=splits == 1, FP32_DOT=x.dtype == torch.float32 or INTERPRETED,
        BLOCK_M=block_m, BLOCK_N=launch.block_n, STEP_GROUPS=launch.step_groups, num_warps=launch.num_warps,
        num_stages=launch.num_stages)
    if splits > 1:
        size = rows * outputs
        _sum_splits_kernel[(triton.cdiv(size, 1024),)](parts, bias, out, size, outputs, SPLITS=splits,
                                                       HAS_BIAS=weight.bias is not None, BLOCK=1024)
    return out
