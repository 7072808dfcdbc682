"""Flattened, ragged batch description for one forward pass over many sequences.

Every sequence contributes a different number of new tokens (a prompt, one decode token, or
the K+1 tokens of a verify pass). Tokens are flattened to [T]; attention regroups them per
sequence in a padded [B, Qmax] layout through `token_index`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.kv_cache import PagedKVCache


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] absolute position of each token in its sequence
    slots: torch.Tensor  # [T] flat cache slot (block * block_size + offset) to write K/V into
    block_tables: torch.Tensor  # [B, max_blocks]
    token_index: torch.Tensor  # [B, Qmax] index into [T] (T = a zero padding row)
    query_positions: torch.Tensor  # [B, Qmax] absolute positions (0 for padding)
    is_token: torch.Tensor  # [B, Qmax] bool, False for padding
    logits_indices: torch.Tensor  # [M] which flat tokens need logits
    uniform_query_len: bool  # every sequence has the same number of new tokens (no padding)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def prepare_forward(cache: PagedKVCache, seq_ids: list[str], new_tokens: list[list[int]],
                    num_logits: list[int]) -> ForwardBatch:
    """Append new_tokens[i] to sequence seq_ids[i] in the cache (allocating blocks) and describe
    the pass. num_logits[i]: logits are produced for that many trailing new tokens of sequence i."""
    device = cache.k.device
    input_ids, positions, slots, logits_indices = [], [], [], []
    query_lens = [len(t) for t in new_tokens]
    if any(q == 0 for q in query_lens):
        raise ValueError("every sequence in a forward pass needs at least one new token")
    offset = 0
    for seq_id, toks, n_logits in zip(seq_ids, new_tokens, num_logits):
        start = cache.length(seq_id)
        slots.append(cache.append_slots(seq_id, len(toks)))
        positions.append(torch.arange(start, start + len(toks)))
        input_ids.extend(toks)
        logits_indices.extend(range(offset + len(toks) - n_logits, offset + len(toks)))
        offset += len(toks)
    total = offset
    qmax = max(query_lens)
    starts = torch.tensor([0] + query_lens[:-1]).cumsum(0)
    col = torch.arange(qmax)
    lens = torch.tensor(query_lens)
    is_token = col[None, :] < lens[:, None]
    token_index = torch.where(is_token, starts[:, None] + col[None, :],
                              torch.full_like(is_token, total, dtype=torch.long))
    flat_positions = torch.cat(positions)
    padded_positions = torch.cat([flat_positions, torch.zeros(1, dtype=torch.long)])[token_index]
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=flat_positions.to(device),
        slots=torch.cat(slots).to(device),
        block_tables=cache.block_tables_tensor(seq_ids),
        token_index=token_index.to(device),
        query_positions=padded_positions.to(device),
        is_token=is_token.to(device),
        logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
        uniform_query_len=all(q == qmax for q in query_lens),
    )
