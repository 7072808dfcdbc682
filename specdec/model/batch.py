"""Flattened, ragged batch description for one forward pass over many sequences.

Every sequence contributes a different number of new tokens (a prompt, one decode token, or
the K+1 tokens of a verify pass). Tokens are flattened to [T]; attention regroups them per
sequence in a padded [B, Qmax] layout through `token_index`.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import torch

from specdec.kv_cache import PagedKVCache


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] absolute position of each token in its sequence
    slots: torch.Tensor  # [T] flat cache slot (block * block_size + offset) to write K/V into
    block_tables: torch.Tensor  # [B, max_blocks]
    # With one sequence whose blocks are consecutive, its keys are the flat cache rows kv_start ..
    # kv_start + L - 1: attention reads them as a view, with no gather at all (None otherwise).
    kv_start: int | None
    token_index: torch.Tensor  # [B, Qmax] index into [T] (T = a zero padding row)
    token_rows: torch.Tensor  # [T] row of each token in the flattened padded [B * Qmax] layout
    token_seqs: torch.Tensor  # [T] which sequence (row of kv_slots) each token belongs to
    query_positions: torch.Tensor  # [B, Qmax] absolute positions (0 for padding)
    logits_indices: torch.Tensor  # [M] which flat tokens need logits
    seq_lens: torch.Tensor  # [B] each sequence's length once this pass's tokens are in
    query_start: torch.Tensor  # [B + 1] sequence b's new tokens are rows query_start[b] .. [b + 1] - 1
    max_query_len: int  # Qmax: the most new tokens any sequence has in this pass
    uniform_query_len: bool  # every sequence has the same number of new tokens (no padding)
    all_logits: bool  # logits_indices is every token in order (a decode step): no gather needed
    block_size: int  # tokens per KV block
    context_len: int  # the longest sequence's length once this pass's tokens are in

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @cached_property
    def kv_slots(self) -> torch.Tensor:
        """[B, L] flat cache slot of each sequence's key positions 0..L-1 (L = context_len; a
        shorter sequence's tail points at some slot and is masked): every layer of the torch path
        and the C kernels gathers its keys through it instead of re-deriving them from the block
        tables. Made on first use: Triton's attention reads the block tables themselves."""
        in_block = torch.arange(self.block_size, device=self.block_tables.device)
        slots = (self.block_tables[:, :, None] * self.block_size + in_block).flatten(1)
        return slots[:, :self.context_len].contiguous()


def prepare_forward(cache: PagedKVCache, seq_ids: list[str], new_tokens: list[list[int]],
                    num_logits: list[int]) -> ForwardBatch:
    """Append new_tokens[i] to sequence seq_ids[i] in the cache (allocating blocks) and describe
    the pass. num_logits[i]: logits are produced for that many trailing new tokens of sequence i."""
    device = cache.k.device
    query_lens = [len(t) for t in new_tokens]
    if any(q == 0 for q in query_lens):
        raise ValueError("every sequence in a forward pass needs at least one new token")
    qmax = max(query_lens)
    total = sum(query_lens)
    input_ids, positions, slots, logits_indices = [], [], [], []
    token_index, query_positions, token_rows, token_seqs = [], [], [], []
    for seq_id, toks, n_logits in zip(seq_ids, new_tokens, num_logits):
        offset, start, pad = len(input_ids), cache.length(seq_id), qmax - len(toks)
        slots += cache.append_slots(seq_id, len(toks))
        positions += range(start, start + len(toks))
        input_ids += toks
        logits_indices += range(offset + len(toks) - n_logits, offset + len(toks))
        # The padded [B, Qmax] layout attention regroups tokens in (padding: row `total`).
        token_index.append(list(range(offset, offset + len(toks))) + [total] * pad)
        query_positions.append(positions[offset:] + [0] * pad)
        token_rows += range(len(token_index) * qmax - qmax, len(token_index) * qmax - pad)
        token_seqs += [len(token_index) - 1] * len(toks)

    seq_lens = [cache.length(s) for s in seq_ids]
    tables = cache.padded_block_tables(seq_ids)
    parts = [input_ids, positions, slots, token_rows, token_seqs, logits_indices, seq_lens,
             [0, *accumulate(query_lens)], [i for row in token_index for i in row],
             [p for row in query_positions for p in row], [b for row in tables for b in row]]
    # Every index of the pass crosses to the device in one copy (on a GPU each copy is a
    # blocking transfer of its own), then splits into views.
    host = torch.tensor([v for part in parts for v in part], dtype=torch.long)  # host: copied once below
    (input_ids_t, positions_t, slots_t, token_rows_t, token_seqs_t, logits_indices_t, seq_lens_t, query_start_t,
     token_index_t, query_positions_t, tables_t) = host.to(device).split([len(part) for part in parts])
    block_tables = tables_t.view(len(seq_ids), len(tables[0]))
    block_size = cache.block_size
    kv_start = None
    if len(seq_ids) == 1:
        table = cache.block_table(seq_ids[0])
        if table == list(range(table[0], table[0] + len(table))):
            kv_start = table[0] * block_size
    return ForwardBatch(
        input_ids=input_ids_t,
        positions=positions_t,
        slots=slots_t,
        block_tables=block_tables,
        kv_start=kv_start,
        token_index=token_index_t.view(len(seq_ids), qmax),
        token_rows=token_rows_t,
        token_seqs=token_seqs_t,
        query_positions=query_positions_t.view(len(seq_ids), qmax),
        logits_indices=logits_indices_t,
        seq_lens=seq_lens_t,
        query_start=query_start_t,
        max_query_len=qmax,
        uniform_query_len=all(q == qmax for q in query_lens),
        all_logits=logits_indices == list(range(total)),
        block_size=block_size,
        context_len=max(seq_lens),
    )
