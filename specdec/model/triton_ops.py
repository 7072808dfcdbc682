"""The small ops of a GPU pass, each fused into one Triton kernel (model.gpu_forward).

Between its four products a layer runs norms, residual adds, the rotary embedding, K/V writes and
SiLU; in torch's ops that is ~20 kernels a layer, each a few microseconds however small its data,
which at batch 1 costs as much as streaming the weights. Fused, a layer is four products and four
kernels. Each kernel rounds where the torch path rounds (a bfloat16 product is rounded to bfloat16
before it is added, as torch does), so the two paths agree to the last bit or nearly.
One program handles one token's row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, h_ptr, width, eps, HAS_DELTA: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    x = tl.load(x_ptr + row * width + cols, mask=ok, other=0.0)
    if HAS_DELTA:  # the residual add, rounded to the stream's dtype as torch's add is
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * width + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * width + cols, x, mask=ok)
    xf = x.to(tl.float32)
    normed = xf * tl.math.rsqrt(tl.sum(xf * xf, 0) / width + eps)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    h = normed.to(h_ptr.dtype.element_ty).to(tl.float32) * weight
    tl.store(h_ptr + row * width + cols, h.to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                       H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]  # q heads, then k heads, then v heads
    half = D // 2
    cols = tl.arange(0, D // 2)[None, :]
    position = tl.load(positions_ptr + token)
    slot = tl.load(slots_ptr + token)
    row = qkv_ptr + token * (H + 2 * HKV) * D + heads * D
    lo = tl.load(row + cols, mask=heads < H + 2 * HKV, other=0.0).to(tl.float32)
    hi = tl.load(row + half + cols, mask=heads < H + 2 * HKV, other=0.0).to(tl.float32)
    cos_lo = tl.load(cos_ptr + position * D + cols).to(tl.float32)
    cos_hi = tl.load(cos_ptr + position * D + half + cols).to(tl.float32)
    sin_lo = tl.load(sin_ptr + position * D + cols).to(tl.float32)
    sin_hi = tl.load(sin_ptr + position * D + half + cols).to(tl.float32)
    dtype = q_ptr.dtype.element_ty
    # x * cos + rotate_half(x) * sin, each product rounded as torch rounds it
    new_lo = (lo * cos_lo).to(dtype).to(tl.float32) + (-hi * sin_lo).to(dtype).to(tl.float32)
    new_hi = (hi * cos_hi).to(dtype).to(tl.float32) + (lo * sin_hi).to(dtype).to(tl.float32)
    new_lo, new_hi = new_lo.to(dtype), new_hi.to(dtype)
    is_q = heads < H
    tl.store(q_ptr + token * H * D + heads * D + cols, new_lo, mask=is_q)
    tl.store(q_ptr + token * H * D + heads * D + half + cols, new_hi, mask=is_q)
    is_k = (heads >= H) & (heads < H + HKV)
    k_row = k_cache_ptr + (slot * HKV + heads - H) * D
    tl.store(k_row + cols, new_lo, mask=is_k)
    tl.store(k_row + half + cols, new_hi, mask=is_k)
    is_v = (heads >= H + HKV) & (heads < H + 2 * HKV)  # v is not rotated
    v_row = v_cache_ptr + (slot * HKV + heads - H - HKV) * D
    tl.store(v_row + cols, lo.to(dtype), mask=is_v)
    tl.store(v_row + half + cols, hi.to(dtype), mask=is_v)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (silu * up).to(dtype), mask=ok)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, W] the residual stream, to which delta ([T, W] or None) is added in place; returns
    rms_norm(x) * weight [T, W]."""
    h = torch.empty_like(x)
    _add_rms_norm_kernel[(x.shape[0],)](x, x if delta is None else delta, weight, h, x.shape[1], eps,
                                        HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(x.shape[1]))
    return h


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                   kv_heads: int) -> torch.Tensor:
    """qkv: [T, (H + 2 Hkv) * D]; cos, sin: the rotary tables [positions, D]; positions, slots:
    [T]; k_cache, v_cache: [blocks, bs, Hkv, D]. Rotates q and k, writes k and v into their
    slots; returns the rotated q [T, H, D]."""
    dim = cos.shape[1]
    q = qkv.new_empty(qkv.shape[0], heads, dim)
    _rope_cache_kernel[(qkv.shape[0],)](qkv, cos, sin, positions, slots, q, k_cache, v_cache, H=heads, HKV=kv_heads,
                                        D=dim, BLOCK_H=triton.next_power_of_2(heads + 2 * kv_heads))
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 I] (gate, then up) -> silu(gate) * up [T, I]."""
    width = gate_up.shape[1] // 2
    out = gate_up.new_empty(gate_up.shape[0], width)
    block = 1024
    _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(width, block))](gate_up, out, width, BLOCK=block)
    return out


def fused_ops_fit(head_dim: int) -> bool:
    """The rotary kernel splits a head in halves of a power-of-two width."""
    return head_dim >= 2 and (head_dim // 2) & (head_dim // 2 - 1) == 0
