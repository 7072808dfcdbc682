"""Attention of new tokens over a paged KV cache (portable torch path, CPU and GPU).

Every gather here is an `index_select` over a flat view through indices computed once per pass
(ForwardBatch.kv_slots, token_rows): multi-dimensional advanced indexing (`cache[block_tables]`)
goes through a generic parallel kernel that costs microseconds on a quiet CPU but milliseconds
when the cores are shared (OpenMP spin-waits), and it ran twice per layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.model.batch import ForwardBatch


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Scatter this pass's K/V ([T, Hkv, D]) into their cache slots (cache: [blocks, bs, Hkv, D];
    in its own dtype: a float16 cache of a float32 model rounds them to nearest)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def attention_mask(batch: ForwardBatch) -> torch.Tensor | None:
    """[R, 1, Qmax, L] bool (L = batch.context_len): the query at position p sees keys 0..p of its
    own attention row (ForwardBatch), which covers causality among the new tokens and hides the padding of shorter
    sequences. None when nothing is hidden (one sequence, one new token): attention then needs no
    mask at all. A tree node's row holds its visible keys first: the same rule covers it."""
    if batch.kv_slots.shape[0] == 1 and batch.token_index.shape[1] == 1 and not batch.has_tree:
        return None
    key_positions = torch.arange(batch.context_len, device=batch.positions.device)
    return (key_positions[None, None, :] <= batch.query_positions[:, :, None]).unsqueeze(1)


def gather_keys(cache: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """cache [blocks, bs, Hkv, D] -> each sequence's keys (or values) [B, Hkv, L, D]."""
    num_seqs, length = batch.kv_slots.shape
    flat = cache.view(-1, *cache.shape[2:])  # [blocks * bs, Hkv, D]
    if batch.kv_start is not None:  # one sequence in consecutive blocks: a view
        return flat[batch.kv_start:batch.kv_start + length].unsqueeze(0).transpose(1, 2)
    return flat.index_select(0, batch.kv_slots.view(-1)).view(num_seqs, length, *cache.shape[2:]).transpose(1, 2)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    batch: ForwardBatch, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q: [T, H, D] (already rotated); mask from attention_mask(batch); returns [T, H, D].

    Each sequence's cached keys are gathered through batch.kv_slots into a padded [B, Hkv, L, D]
    tensor (with no mask, exactly the one sequence's keys), or viewed in place (batch.kv_start).
    """
    num_seqs, qmax = batch.token_index.shape
    heads, dim = q.shape[1], q.shape[2]
    if batch.uniform_query_len:
        q_padded = q.view(num_seqs, qmax, heads, dim)
    else:
        q_padded = torch.cat([q, q.new_zeros(1, heads, dim)]).index_select(0, batch.token_index.view(-1))
        q_padded = q_padded.view(num_seqs, qmax, heads, dim)
    keys, values = gather_keys(k_cache, batch).to(q.dtype), gather_keys(v_cache, batch).to(q.dtype)
    out = F.scaled_dot_product_attention(
        q_padded.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
        enable_gqa=keys.shape[1] != heads,
    ).transpose(1, 2)  # [B, Qmax, H, D]
    if batch.uniform_query_len:
        return out.reshape(-1, heads, dim)
    return out.reshape(num_seqs * qmax, heads, dim).index_select(0, batch.token_rows)
