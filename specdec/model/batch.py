"""Flattened, ragged batch description for one forward pass over many sequences.

Every sequence contributes a different number of new tokens (a prompt, one decode token, or
the K+1 tokens of a verify pass). Tokens are flattened to [T]; attention regroups them in a
padded [R, Qmax] layout through `token_index`, one row per attention row: a sequence's causal
tokens share its row, and each node of a token tree (TreeNodes) has a row of its own, whose keys
are the sequence's prefix and the node's path, so siblings never see each other.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import numpy as np
import torch

from specdec.kv_cache import PagedKVCache


@dataclass(frozen=True)
class TreeNodes:
    """The last len(paths) new tokens of a sequence are nodes of a token tree.

    start: the cache index of the tree's first node; every node sees the cache positions before it.
    paths[j]: the cache indices (ascending, all >= start) of node j's tree ancestors, then its own.
    Node j then sits at position start + len(paths[j]) - 1 (its depth below the tree's root)."""

    start: int
    paths: list[list[int]]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] absolute position of each token in its sequence
    slots: torch.Tensor  # [T] flat cache slot (block * block_size + offset) to write K/V into
    block_tables: torch.Tensor  # [B, max_blocks]
    # With one sequence whose blocks are consecutive, its keys are the flat cache rows kv_start ..
    # kv_start + L - 1: attention reads them as a view, with no gather at all (None otherwise).
    kv_start: int | None
    token_index: torch.Tensor  # [R, Qmax] index into [T] (T = a zero padding row)
    token_rows: torch.Tensor  # [T] row of each token in the flattened padded [R * Qmax] layout
    token_seqs: torch.Tensor  # [T] each token's attention row (row of kv_slots): its sequence's, or its node's
    query_positions: torch.Tensor  # [R, Qmax] absolute positions (0 for padding)
    logits_indices: torch.Tensor  # [M] which flat tokens need logits
    seq_lens: torch.Tensor  # [B] each sequence's length once this pass's tokens are in
    query_start: torch.Tensor  # [B + 1] sequence b's new tokens are rows query_start[b] .. [b + 1] - 1
    max_query_len: int  # Qmax: the most new tokens any sequence has in this pass
    uniform_query_len: bool  # every sequence has the same number of new tokens (no padding)
    all_logits: bool  # logits_indices is every token in order (a decode step): no gather needed
    block_size: int  # tokens per KV block
    context_len: int  # the longest sequence's length once this pass's tokens are in
    # [R, L] with tree nodes: each attention row's key slots (a node's: the prefix, then its path);
    # None: one causal row per sequence, derived from the block tables (kv_slots).
    tree_kv_slots: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def has_tree(self) -> bool:
        return self.tree_kv_slots is not None

    @cached_property
    def kv_slots(self) -> torch.Tensor:
        """[R, L] flat cache slot of each attention row's keys 0..L-1 (L = context_len; a shorter
        row's tail points at some slot and is masked): every layer of the torch path and the C
        kernels gathers its keys through it instead of re-deriving them from the block tables. Made
        on first use: Triton's attention reads the block tables themselves."""
        if self.tree_kv_slots is not None:
            return self.tree_kv_slots
        if self.kv_start is not None:  # one sequence in consecutive blocks: one range (a decode step's case)
            return torch.arange(self.kv_start, self.kv_start + self.context_len,
                                device=self.block_tables.device).view(1, self.context_len)
        return sequence_kv_slots(self.block_tables, self.block_size, self.context_len)


def sequence_kv_slots(block_tables: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """[B, length] flat cache slot of each sequence's positions 0..length-1 (block_tables [B, n])."""
    in_block = torch.arange(block_size, device=block_tables.device)
    slots = (block_tables[:, :, None] * block_size + in_block).flatten(1)
    return slots[:, :length].contiguous()


def prepare_forward(cache: PagedKVCache, seq_ids: list[str], new_tokens: list[list[int]],
                    num_logits: list[int], trees: list[TreeNodes | None] | None = None) -> ForwardBatch:
    """Append new_tokens[i] to sequence seq_ids[i] in the cache (allocating blocks) and describe
    the pass. num_logits[i]: logits are produced for that many trailing new tokens of sequence i.
    trees[i]: which of sequence i's new tokens are tree nodes (None: all are causal)."""
    device = cache.k.device
    trees = trees or [None] * len(seq_ids)
    query_lens = [len(t) for t in new_tokens]
    if any(q == 0 for q in query_lens):
        raise ValueError("every sequence in a forward pass needs at least one new token")
    total = sum(query_lens)
    input_ids, positions, slots, logits_indices = [], [], [], []
    block_size = cache.block_size
    rows: list[tuple[list[int], int]] = []  # attention rows: (flat indices of its tokens, its sequence)
    node_keys: list[tuple[int, int, int]] = []  # (row, key, slot): a tree node's keys from its tree's start
    for seq, (seq_id, toks, n_logits, tree) in enumerate(zip(seq_ids, new_tokens, num_logits, trees)):
        offset, start = len(input_ids), cache.length(seq_id)
        slots += cache.append_slots(seq_id, len(toks))
        input_ids += toks
        logits_indices += range(offset + len(toks) - n_logits, offset + len(toks))
        causal = len(toks) - (len(tree.paths) if tree else 0)
        positions += range(start, start + causal)
        if causal:
            rows.append((list(range(offset, offset + causal)), seq))
        for j, path in enumerate(tree.paths if tree else []):
            if path[-1] != start + causal + j or path[0] < tree.start or path != sorted(set(path)):
                raise ValueError(f"tree node {j} of {seq_id!r}: path {path} must ascend from the tree start "
                                 f"{tree.start} to the node's own cache index {start + causal + j}")
            positions.append(tree.start + len(path) - 1)
            node_keys += [(len(rows), tree.start + k, slot) for k, slot in enumerate(cache.slots(seq_id, path))]
            rows.append(([offset + causal + j], seq))
    qmax = max(len(tokens) for tokens, _ in rows)
    token_index, query_positions, token_rows, token_seqs = [], [], [0] * total, [0] * total
    for r, (tokens, _) in enumerate(rows):
        pad = qmax - len(tokens)
        # The padded [R, Qmax] layout attention regroups tokens in (padding: row `total`).
        token_index.append(tokens + [total] * pad)
        query_positions.append([positions[t] for t in tokens] + [0] * pad)
        for i, t in enumerate(tokens):
            token_rows[t], token_seqs[t] = r * qmax + i, r

    seq_lens = [cache.length(s) for s in seq_ids]
    tables = cache.padded_block_tables(seq_ids)
    parts = [input_ids, positions, slots, token_rows, token_seqs, logits_indices, seq_lens,
             [0, *accumulate(query_lens)], [i for row in token_index for i in row],
             [p for row in query_positions for p in row], [b for row in tables for b in row]]
    # Every index of the pass crosses to the device in one copy (on a GPU each copy is a
    # blocking transfer of its own), then splits into views.
    # (array -> frombuffer: half the time of torch.tensor(list); split_with_sizes skips split's checks)
    host = torch.frombuffer(array("q", [v for part in parts for v in part]), dtype=torch.int64)
    (input_ids_t, positions_t, slots_t, token_rows_t, token_seqs_t, logits_indices_t, seq_lens_t, query_start_t,
     token_index_t, query_positions_t, tables_t) = host.to(device).split_with_sizes(list(map(len, parts)))
    block_tables = tables_t.view(len(seq_ids), len(tables[0]))
    context_len = max(seq_lens)
    kv_start = None
    if len(seq_ids) == 1 and not node_keys:
        table = cache.block_table(seq_ids[0])
        if table == list(range(table[0], table[0] + len(table))):
            kv_start = table[0] * block_size
    tree_kv_slots = None
    if node_keys:
        tree_kv_slots = _tree_kv_slots(tables, block_size, context_len, [seq for _, seq in rows], node_keys, device)
    return ForwardBatch(
        input_ids=input_ids_t,
        positions=positions_t,
        slots=slots_t,
        block_tables=block_tables,
        kv_start=kv_start,
        token_index=token_index_t.view(len(rows), qmax),
        token_rows=token_rows_t,
        token_seqs=token_seqs_t,
        query_positions=query_positions_t.view(len(rows), qmax),
        logits_indices=logits_indices_t,
        seq_lens=seq_lens_t,
        query_start=query_start_t,
        max_query_len=qmax,
        uniform_query_len=not node_keys and all(q == qmax for q in query_lens),
        all_logits=logits_indices == list(range(total)),
        block_size=block_size,
        context_len=context_len,
        tree_kv_slots=tree_kv_slots,
    )


def _tree_kv_slots(tables: list[list[int]], block_size: int, length: int, row_seqs: list[int],
                   node_keys: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    """[R, length] key slots of every attention row: its sequence's causal row, where a tree node's
    row then holds its path's slots from the tree's start on (node_keys: (row, key, slot)). Made in
    numpy on the host, then one copy: a tree pass's Python runs cold between the passes, where each
    of torch's dozen small ops cost several times its warm ~3 us."""
    table = np.asarray(tables, dtype=np.int64)  # [B, n]
    causal = (table[:, :, None] * block_size + np.arange(block_size)).reshape(len(tables), -1)[:, :length]
    rows = causal[row_seqs]  # (a copy)
    at_rows, at_keys, slots = np.asarray(node_keys, dtype=np.int64).T
    rows[at_rows, at_keys] = slots
    return torch.from_numpy(rows).to(device)
