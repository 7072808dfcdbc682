"""Paged KV cache as a data structure: the block allocator, slot math, rollback, and exact block
accounting under random operations. The cache in use (a failed pass, the target worker's verify
rounds, scheduler churn, its size on an accelerator) is tested in test_kv_cache_in_use.py."""
from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.kv_cache import BlockAllocator, KVCacheFull, PagedKVCache

# ---------------------------------------------------------------- BlockAllocator

def test_allocator_hands_out_low_ids_first_and_counts():
    a = BlockAllocator(5)
    assert (a.num_free, a.num_used) == (5, 0)
    assert a.allocate(2) == [0, 1]
    assert a.allocate(0) == []
    assert (a.num_free, a.num_used) == (3, 2)
    assert a.allocate(3) == [2, 3, 4]
    assert a.num_free == 0


def test_allocator_full_raises_and_changes_nothing():
    a = BlockAllocator(3)
    a.allocate(2)
    with pytest.raises(KVCacheFull, match="need 2 KV blocks, only 1 free"):
        a.allocate(2)
    assert a.num_free == 1
    assert a.allocate(1) == [2]


def test_allocator_free_reuses_blocks():
    a = BlockAllocator(4)
    blocks = a.allocate(4)
    a.free([blocks[1], blocks[3]])
    assert a.num_free == 2
    assert sorted(a.allocate(2)) == [1, 3]


def test_allocator_double_free_raises():
    a = BlockAllocator(3)
    b = a.allocate(2)
    a.free(b[:1])
    with pytest.raises(AssertionError, match="freed twice"):
        a.free(b[:1])
    with pytest.raises(AssertionError, match="freed twice"):
        a.free([2])  # never allocated


def test_allocator_needs_a_block():
    with pytest.raises(ValueError):
        BlockAllocator(0)


# ---------------------------------------------------------------- PagedKVCache slot math

def _cache(num_blocks=8, block_size=4) -> PagedKVCache:
    return PagedKVCache(num_layers=1, num_blocks=num_blocks, block_size=block_size, num_kv_heads=1, head_dim=2)


def test_append_slots_math_and_block_growth():
    c = _cache()
    c.add_sequence("a")
    assert c.append_slots("a", 3) == [0, 1, 2]
    assert c.block_table("a") == [0]
    c.add_sequence("b")
    assert c.append_slots("b", 2) == [4, 5]  # block 1
    # a grows across a block boundary: rest of block 0, then a new block (2)
    assert c.append_slots("a", 3) == [3, 8, 9]
    assert c.block_table("a") == [0, 2]
    assert c.length("a") == 6 and c.length("b") == 2
    assert c.append_slots("a", 0) == []
    c.check_accounting()


def test_truncate_frees_trailing_blocks_and_keeps_partial_block():
    c = _cache()
    c.add_sequence("a")
    c.append_slots("a", 10)  # blocks 0, 1, 2
    c.truncate_to("a", 9)
    assert c.block_table("a") == [0, 1, 2] and c.allocator.num_used == 3
    c.truncate_to("a", 8)
    assert c.block_table("a") == [0, 1] and c.allocator.num_used == 2
    c.truncate_to("a", 5)
    assert c.block_table("a") == [0, 1]
    c.truncate_to("a", 4)
    assert c.block_table("a") == [0]
    # re-growing overwrites the freed slots (positions 4.. go to a fresh block)
    slots = c.append_slots("a", 2)
    assert c.length("a") == 6 and len(c.block_table("a")) == 2
    assert slots == [c.block_table("a")[1] * 4 + 0, c.block_table("a")[1] * 4 + 1]
    c.truncate_to("a", 0)
    assert c.block_table("a") == [] and c.allocator.num_used == 0
    c.check_accounting()


def test_truncate_out_of_range_raises():
    c = _cache()
    c.add_sequence("a")
    c.append_slots("a", 3)
    with pytest.raises(ValueError):
        c.truncate_to("a", 4)
    with pytest.raises(ValueError):
        c.truncate_to("a", -1)
    assert c.length("a") == 3


def test_free_sequence_returns_blocks_for_reuse():
    c = _cache(num_blocks=4)
    c.add_sequence("a")
    c.append_slots("a", 8)
    c.add_sequence("b")
    c.append_slots("b", 8)
    assert c.allocator.num_free == 0
    with pytest.raises(KVCacheFull):
        c.append_slots("b", 1)
    a_blocks = list(c.block_table("a"))
    c.free_sequence("a")
    assert not c.has_sequence("a")
    c.free_sequence("a")  # unknown id: no-op
    c.add_sequence("c")
    c.append_slots("c", 5)
    assert sorted(c.block_table("c")) == sorted(a_blocks)
    c.check_accounting()
    c.free_sequence("b")
    c.free_sequence("c")
    assert c.allocator.num_used == 0
    c.check_accounting()


def test_append_when_full_leaves_sequence_unchanged():
    c = _cache(num_blocks=2)
    c.add_sequence("a")
    c.append_slots("a", 6)
    with pytest.raises(KVCacheFull):
        c.append_slots("a", 3)
    assert c.length("a") == 6 and c.block_table("a") == [0, 1]
    c.check_accounting()


def test_add_sequence_twice_raises():
    c = _cache()
    c.add_sequence("a")
    with pytest.raises(ValueError, match="already"):
        c.add_sequence("a")


def test_block_tables_are_padded_with_zero():
    c = _cache()
    for s, n in (("a", 9), ("b", 1), ("e", 0)):
        c.add_sequence(s)
        c.append_slots(s, n)
    assert c.padded_block_tables(["a", "b", "e"]) == [[0, 1, 2], [3, 0, 0], [0, 0, 0]]


def test_check_accounting_detects_corruption():
    c = _cache()
    c.add_sequence("a")
    c.append_slots("a", 5)
    c.add_sequence("b")
    c.append_slots("b", 1)
    c.check_accounting()
    # a block owned by two sequences
    bad = copy.deepcopy(c)
    bad._tables["b"].append(bad._tables["a"][0])
    with pytest.raises(AssertionError):
        bad.check_accounting()
    # a leaked block: owned by nobody, not free
    bad = copy.deepcopy(c)
    bad._tables["a"].pop()
    with pytest.raises(AssertionError):
        bad.check_accounting()
    # a block both owned and free
    bad = copy.deepcopy(c)
    bad.allocator._free.append(bad._tables["a"][0])
    with pytest.raises(AssertionError):
        bad.check_accounting()
    # table size disagrees with length
    bad = copy.deepcopy(c)
    bad._lengths["a"] = 9
    with pytest.raises(AssertionError):
        bad.check_accounting()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "append", "truncate", "free"]),
                          st.integers(0, 3), st.integers(0, 9)), max_size=40))
def test_random_cache_operations_keep_accounting(ops):
    """Against a plain model of lengths: accounting holds and live slots never collide."""
    c = _cache(num_blocks=10, block_size=3)
    lengths: dict[str, int] = {}
    slots: dict[str, list[int]] = {}
    for op, which, n in ops:
        sid = f"s{which}"
        if op == "add":
            if sid in lengths:
                continue
            c.add_sequence(sid)
            lengths[sid], slots[sid] = 0, []
        elif op == "append" and sid in lengths:
            try:
                new = c.append_slots(sid, n)
            except KVCacheFull:
                assert c.blocks_needed(lengths[sid] + n) - len(c.block_table(sid)) > c.allocator.num_free
                continue
            lengths[sid] += n
            slots[sid] += new
        elif op == "truncate" and sid in lengths:
            keep = min(n, lengths[sid])
            c.truncate_to(sid, keep)
            lengths[sid] = keep
            del slots[sid][keep:]
        elif op == "free" and sid in lengths:
            c.free_sequence(sid)
            del lengths[sid], slots[sid]
        c.check_accounting()
        for s, length in lengths.items():
            assert c.length(s) == length
            table = c.block_table(s)
            assert slots[s] == [table[i // 3] * 3 + i % 3 for i in range(length)]
        live = [x for v in slots.values() for x in v]
        assert len(live) == len(set(live))
    for s in list(lengths):
        c.free_sequence(s)
    assert c.allocator.num_used == 0
    c.check_accounting()
