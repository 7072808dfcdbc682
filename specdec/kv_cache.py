"""Paged KV cache: fixed-size blocks, a block table per sequence, exact block accounting.

Each sequence owns an ordered list of block ids; token i of the sequence lives in block
table[i // block_size] at offset i % block_size. Rolling back after rejected draft tokens is
`truncate_to`, which returns now-unused trailing blocks to the free pool at once.
"""
from __future__ import annotations

import torch


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens tokens (the one place this rounding is written)."""
    return -(-num_tokens // block_size)


class KVCacheFull(RuntimeError):
    """Not enough free blocks; the scheduler should not have admitted this much work."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        # Pop from the end: low block ids are handed out first, which keeps tests readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheFull(f"need {n} KV blocks, only {len(self._free)} free of {self.num_blocks}")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._is_free[b] = False
        return blocks

    def free(self, blocks: list[int]) -> None:
        # Pushed in reverse, so a freed run of blocks is handed out again in ascending order: a lone
        # sequence then keeps consecutive blocks, which attention reads without a gather.
        for b in reversed(blocks):
            if self._is_free[b]:
                raise AssertionError(f"KV block {b} freed twice")
            self._is_free[b] = True
            self._free.append(b)


class PagedKVCache:
    """K and V storage for every layer plus per-sequence block tables."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.block_size = block_size
        self.num_layers = num_layers
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.allocator = BlockAllocator(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self._lengths: dict[str, int] = {}
        self.reserved: list[int] = []  # blocks no sequence owns (reserve_block)

    # -- sequence bookkeeping -------------------------------------------------------------
    def add_sequence(self, seq_id: str) -> None:
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has a KV cache")
        self._tables[seq_id] = []
        self._lengths[seq_id] = 0

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def sequence_ids(self) -> list[str]:
        return list(self._tables)

    def length(self, seq_id: str) -> int:
        return self._lengths[seq_id]

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def append_slots(self, seq_id: str, num_new: int) -> list[int]:
        """Grow the sequence by num_new tokens (allocating blocks) and return their flat slots.

        Plain Python ints: a pass builds one tensor from every sequence's slots, instead of a few
        small tensors per sequence."""
        start = self._lengths[seq_id]
        new_len = start + num_new
        table = self._tables[seq_id]
        missing = self.blocks_needed(new_len) - len(table)
        if missing > 0:
            table.extend(self.allocator.allocate(missing))
        self._lengths[seq_id] = new_len
        return self.slots(seq_id, range(start, new_len))

    def slots(self, seq_id: str, indices) -> list[int]:
        """The flat cache slots of the sequence's tokens at `indices` (cache indices it holds)."""
        table, size = self._tables[seq_id], self.block_size
        return [table[i // size] * size + i % size for i in indices]

    def truncate_to(self, seq_id: str, length: int) -> None:
        """Keep only the first `length` tokens; trailing blocks go back to the pool now."""
        if length < 0 or length > self._lengths[seq_id]:
            raise ValueError(f"cannot truncate {seq_id!r} of length {self._lengths[seq_id]} to {length}")
        table = self._tables[seq_id]
        keep = self.blocks_needed(length)
        if keep < len(table):
            self.allocator.free(table[keep:])
            del table[keep:]
        self._lengths[seq_id] = length

    def keep_path(self, seq_id: str, start: int, path: list[int]) -> None:
        """Keep the first `start` tokens and then the tokens at cache indices `path` (ascending, all
        >= start: a tree's accepted nodes), moved in place to start, start + 1, ..; the rest goes.
        Each token moves to an index at or below its own, and earlier than any later source, so the
        copies in order never overwrite a token still to move."""
        ascending = all(a < b for a, b in zip(path, path[1:]))
        if not ascending or (path and not start <= path[0] <= path[-1] < self.length(seq_id)):
            raise ValueError(f"cannot keep path {path} after {start} tokens of {seq_id!r}")
        moves = [(index, start + k) for k, index in enumerate(path) if index != start + k]
        if moves:
            sources, targets = zip(*moves)
            source_t = torch.tensor(self.slots(seq_id, sources), device=self.k.device)
            target_t = torch.tensor(self.slots(seq_id, targets), device=self.k.device)
            for cache in (self.k, self.v):
                flat = cache.view(cache.shape[0], -1, *cache.shape[3:])  # [layers, slots, Hkv, D]
                flat.index_copy_(1, target_t, flat.index_select(1, source_t))
        self.truncate_to(seq_id, start + len(path))

    def reserve_block(self) -> int:
        """Take one block out of the pool for good: the padding rows of a replayed CUDA graph
        write their keys there (model.cuda_graphs), where no sequence reads them."""
        block = self.allocator.allocate(1)[0]
        self.reserved.append(block)
        return block

    def free_sequence(self, seq_id: str) -> None:
        table = self._tables.pop(seq_id, None)
        self._lengths.pop(seq_id, None)
        if table:
            self.allocator.free(table)

    def check_accounting(self) -> None:
        """Every block is owned by exactly one live sequence or is free (used by tests)."""
        owned = [b for t in self._tables.values() for b in t] + self.reserved
        if len(owned) != len(set(owned)):
            raise AssertionError("a KV block is owned by two sequences")
        free = set(self.allocator._free)
        if free & set(owned):
            raise AssertionError("a KV block is both free and owned")
        if len(free) + len(owned) != self.allocator.num_blocks or len(free) != len(self.allocator._free):
            raise AssertionError("KV blocks leaked or duplicated in the free list")
        for seq_id, table in self._tables.items():
            if len(table) != self.blocks_needed(self._lengths[seq_id]):
                raise AssertionError(f"sequence {seq_id!r} holds {len(table)} blocks "
                                     f"for {self._lengths[seq_id]} tokens")

    def padded_block_tables(self, seq_ids: list[str]) -> list[list[int]]:
        """[B][max_blocks] padded with block 0 (padding is masked out by context length): plain
        ints, which a pass copies to the device with its other indices (model.batch)."""
        width = max(1, max(len(self._tables[s]) for s in seq_ids))
        return [self._tables[s] + [0] * (width - len(self._tables[s])) for s in seq_ids]
