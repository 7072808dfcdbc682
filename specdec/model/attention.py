"""Attention of new tokens over a paged KV cache (portable torch path, CPU and GPU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.model.batch import ForwardBatch


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Scatter this pass's K/V ([T, Hkv, D]) into their cache slots (cache: [blocks, bs, Hkv, D])."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def attention_mask(batch: ForwardBatch) -> torch.Tensor | None:
    """[B, 1, Qmax, L] bool: the query at position p sees keys 0..p of its own sequence, which
    covers causality among the new tokens and hides the padding of shorter sequences. None when
    nothing is hidden (one sequence, one new token): attention then needs no mask at all."""
    if batch.block_tables.shape[0] == 1 and batch.token_index.shape[1] == 1:
        return None
    key_positions = torch.arange(batch.block_tables.shape[1] * batch.block_size, device=batch.positions.device)
    return (key_positions[None, None, :] <= batch.query_positions[:, :, None]).unsqueeze(1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    batch: ForwardBatch, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q: [T, H, D] (already rotated); mask from attention_mask(batch); returns [T, H, D].

    Each sequence's cached keys are gathered through its block table into a padded [B, Hkv, L, D]
    view (L = its blocks x block size; with no mask, exactly the one sequence's length).
    """
    num_seqs, qmax = batch.token_index.shape
    heads, dim = q.shape[1], q.shape[2]
    if batch.uniform_query_len:
        q_padded = q.view(num_seqs, qmax, heads, dim)
    else:
        q_padded = torch.cat([q, q.new_zeros(1, heads, dim)])[batch.token_index]
    keys = k_cache[batch.block_tables].flatten(1, 2)  # [B, L, Hkv, D]
    values = v_cache[batch.block_tables].flatten(1, 2)
    if mask is None:  # one sequence, one query: its keys are exactly the first context_len slots
        keys, values = keys[:, :batch.context_len], values[:, :batch.context_len]
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, L, D]
    out = F.scaled_dot_product_attention(
        q_padded.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
        enable_gqa=keys.shape[1] != heads,
    ).transpose(1, 2)  # [B, Qmax, H, D]
    if batch.uniform_query_len:
        return out.reshape(-1, heads, dim)
    return out[batch.is_token]
