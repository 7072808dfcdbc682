"""The forward pass with specdec's C kernels (specdec.model.cpu_kernels) between the products.

Same math as Model.forward's torch path, in fewer calls: per layer four projections and four C
calls instead of some forty torch ops (each 5-70 us of dispatch on a small CPU, for a microsecond
of arithmetic); README, "Decode step against its physical floor", has what it saves. The residual
stream x is updated in place: each norm call first adds the previous block's output (delta) to it.

Attention runs in C on the calling thread, which beats torch's two-thread kernel while a pass has
few (new token, context position) pairs, as in decoding and verifying at short and middling
contexts; past MAX_ATTENTION_PAIRS (a long context) torch's attention takes over. Passes of more
than MAX_TOKENS tokens (prompts) run torch's ops throughout: there the products dwarf the small
ops, which torch spreads over every thread while the C kernels use one.
"""
from __future__ import annotations

import torch

from specdec.kv_cache import PagedKVCache
from specdec.model.attention import attention_mask, paged_attention
from specdec.model.batch import ForwardBatch

# The most (new tokens x context length) a pass may have for attention in C: one thread reading
# each key once per kv head (~20 ns per key and q head on the 2-core dev CPU) against torch's SDPA
# on two threads with ~50 us of dispatch a layer. Measured on a SmolLM2-135M shape, whole passes
# with C attention against torch's: 0.8x the time at batch 1 and contexts 110-1000, 0.9x at batch 8
# and context 110, parity around 2000 (batch 1 at 2000 tokens: 1.05x; 8 x 600: 0.97x).
MAX_ATTENTION_PAIRS = 2048
# The most tokens a pass may have for this path (a batch of 8 verify passes of K = 5 is 48).
MAX_TOKENS = 64


def kernel_forward_fits(batch: ForwardBatch, max_positions: int) -> bool:
    """Whether this path should run `batch`: few tokens, and every position inside the rotary table,
    which the C kernels read unchecked (torch's lookup raises the clear error instead)."""
    return batch.num_tokens <= MAX_TOKENS and batch.context_len <= max_positions


@torch.inference_mode()
def kernel_forward(model, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
    """Model.forward for a float32 CPU model with kernels loaded; returns float32 logits [M, V]."""
    c, w, lib = model.config, model.weights, model.kernels
    tokens, hidden, eps = batch.num_tokens, c.hidden_size, c.rms_norm_eps
    heads, kv_heads, dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    x = w.embed.index_select(0, batch.input_ids)  # [T, hidden] the residual stream (a fresh copy)
    h = torch.empty_like(x)  # [T, hidden] each norm's output
    act = x.new_empty(tokens, c.intermediate_size)  # [T, I] silu(gate) * up
    c_attention = tokens * batch.context_len <= MAX_ATTENTION_PAIRS
    if c_attention:  # C writes attention into attn [T, H * D], with scores as its scratch
        attn, scores = x.new_empty(tokens, heads * dim), x.new_empty(heads // kv_heads * batch.context_len)
    mask = None if c_attention else attention_mask(batch)
    positions, slots = batch.positions.data_ptr(), batch.slots.data_ptr()
    token_seqs, kv_slots = batch.token_seqs.data_ptr(), batch.kv_slots.data_ptr()
    cos, sin = model.rotary.cos.data_ptr(), model.rotary.sin.data_ptr()
    delta = None  # [T, hidden] the last block's output, not yet added to x
    for index, layer in enumerate(w.layers):
        k_cache, v_cache = cache.k[index].data_ptr(), cache.v[index].data_ptr()
        lib.add_rms_norm(x.data_ptr(), delta, layer.input_norm.data_ptr(), h.data_ptr(), tokens, hidden, eps)
        qkv = layer.qkv(h)  # [T, (H + 2 Hkv) * D]
        qk_norm = None if layer.qk_norm is None else layer.qk_norm.data_ptr()
        lib.rope_store_kv(qkv.data_ptr(), tokens, heads, kv_heads, dim, positions, cos, sin, qk_norm, eps,
                          slots, k_cache, v_cache)
        if c_attention:
            lib.attend(qkv.data_ptr(), tokens, heads, kv_heads, dim, token_seqs, positions, kv_slots,
                       batch.context_len, k_cache, v_cache, model.scale, attn.data_ptr(), scores.data_ptr())
        else:
            q = qkv[:, :heads * dim].view(tokens, heads, dim)  # rotated in place by rope_store_kv
            attn = paged_attention(q, cache.k[index], cache.v[index], batch, mask, model.scale).reshape(tokens, -1)
        out = layer.o_proj(attn)  # [T, hidden]
        lib.add_rms_norm(x.data_ptr(), out.data_ptr(), layer.post_norm.data_ptr(), h.data_ptr(), tokens,
                         hidden, eps)
        gate_up = layer.gate_up(h)  # [T, 2 I]
        lib.silu_mul(gate_up.data_ptr(), act.data_ptr(), tokens, c.intermediate_size)
        down = layer.down(act)  # [T, hidden]; kept referenced until the next norm reads it
        delta = down.data_ptr()
    lib.add_rms_norm(x.data_ptr(), delta, w.final_norm.data_ptr(), h.data_ptr(), tokens, hidden, eps)
    if not batch.all_logits:
        h = h.index_select(0, batch.logits_indices)
    return w.lm_head(h).float()
