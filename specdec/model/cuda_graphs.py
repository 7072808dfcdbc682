"""CUDA graphs for the passes that repeat every round: decode steps, draft steps and verify passes.

A small model's pass on a GPU is a few hundred short kernels; launched one by one from Python it
costs more in launches than in the kernels (the draft's cost ratio c then tends to 1). A graph
captured once replays all of them in one launch. Terms:
- a *uniform pass*: every sequence feeds the same number q of new tokens and wants logits for all
  of them (a decode or draft step: q = 1; a verify pass: q = K + 1).
- any other pass of at most MAX_GRAPH_QUERY_LEN new tokens a sequence: sequences that feed
  different numbers (verify passes where requests drafted different K, the draft's catch-up after
  different acceptance) or want logits for their last tokens only (that catch-up, short prompts).
  It replays the graph of its longest sequence's q: a shorter sequence's missing tokens are
  padding (token 0 at its last position, written into the reserved block), and only the wanted
  tokens' logits are kept. Longer passes (prompts) and token trees run eagerly.
- a *bucket*: the batch sizes a graph is captured at (1, 2, 4, 8, then multiples of 8). A batch
  of n sequences replays the graph of the smallest bucket >= n; its other rows are *padding*:
  they feed token 0 at positions 0..q-1 of a block the cache reserved for them (reserve_block),
  so they write and read keys no sequence owns.
Graphs are captured when the runner starts (capture_all: every bucket and q; 1.7-6 s for a 1B
model on an H200), each after one eager warm-up that compiles the Triton kernels. Captured on first
use instead, a round that met a new (bucket, q) took a capture's time, and the adaptive policy,
which learns its costs from measured rounds, learnt that drafting is dear (docs/gpu-2026-11-30.md).
What changes between replays (token ids, positions, slots, block tables, lengths) is copied into
the graph's input tensors; attention reads lengths from those tensors (model.triton_attention), so
one graph serves every context length.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from specdec.kv_cache import PagedKVCache
from specdec.model.batch import ForwardBatch

log = logging.getLogger(__name__)
MAX_GRAPH_QUERY_LEN = 16  # the longest q replayed (K + 1 of a verify pass); longer passes run eagerly


def graph_logits_bytes(vocab_size: int, max_batch: int) -> int:
    """The buffer every graph writes its logits to: the largest bucket's MAX_GRAPH_QUERY_LEN rows."""
    return bucket_sizes(max_batch)[-1] * MAX_GRAPH_QUERY_LEN * vocab_size * 4  # (float32)


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to and including max_batch's bucket."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] + 8)
    return [s for s in sizes if s < max_batch] + [next(s for s in sizes if s >= max_batch)]


@dataclass
class _Captured:
    batch: ForwardBatch  # the graph's input tensors, as a batch the model reads
    graph: object  # torch.cuda.CUDAGraph, or None where replay runs the pass eagerly (tests on a CPU)


class GraphedPasses:
    """Model.forward through CUDA graphs for the passes the module docstring names, eager otherwise.
    capture=False replays by running the captured batch eagerly: the same input tensors and
    padding, testable on a CPU."""

    def __init__(self, model, cache: PagedKVCache, max_batch: int, capture: bool = True):
        self.model = model
        self.cache = cache
        self.buckets = bucket_sizes(max_batch)
        self.capture = capture
        self.scratch_block = cache.reserve_block()
        self.table_width = min(cache.allocator.num_blocks,
                               -(-model.config.max_position_embeddings // cache.block_size))
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        # Padding's positions and slots (a block of the reserved one's offsets), made once: a ragged
        # pass or a padded bucket takes its first q, with no new tensor on the way to a replay.
        self.max_query_len = min(MAX_GRAPH_QUERY_LEN, cache.block_size)
        self._in_block = torch.arange(self.max_query_len, device=model.device)
        self._scratch_slots = self._in_block + self.scratch_block * cache.block_size
        # Every graph writes its logits here: one kept per graph, a 128k vocabulary's would take
        # 6 GB over the buckets and q (the pool reuses the rest of a graph's memory in the next).
        self.logits = torch.empty(self.buckets[-1] * MAX_GRAPH_QUERY_LEN, model.config.vocab_size,
                                  dtype=torch.float32, device=model.device)  # (graph_logits_bytes)
        self._captured: dict[tuple[int, int], _Captured] = {}
        self.replays = 0

    def capture_all(self) -> None:
        """Capture (or, without capture, prepare) the graph of every bucket and q replayed."""
        began = time.perf_counter()
        for bucket in self.buckets:
            for q in range(1, self.max_query_len + 1):
                if (bucket, q) not in self._captured:
                    self._capture(bucket, q)
        log.info("CUDA graphs for batches up to %d and 1-%d new tokens a sequence: %d, captured in %.1f s",
                 self.buckets[-1], self.max_query_len, len(self._captured), time.perf_counter() - began)

    def replayable(self, batch: ForwardBatch) -> bool:
        return (not batch.has_tree
                and batch.max_query_len <= self.max_query_len
                and batch.block_tables.shape[0] <= self.buckets[-1]
                and batch.block_tables.shape[1] <= self.table_width
                and batch.context_len <= self.model.rotary.cos.shape[0])

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Model.forward(batch, cache): float32 logits [T, vocab] (a tensor of its own)."""
        if not self.replayable(batch):
            return self.model.forward(batch, self.cache)
        num_seqs, q = batch.block_tables.shape[0], batch.max_query_len
        bucket = next(b for b in self.buckets if b >= num_seqs)
        captured = self._captured.get((bucket, q)) or self._capture(bucket, q)
        self._load(captured.batch, batch, num_seqs, q)
        if captured.graph is None:
            self.logits[:bucket * q].copy_(self.model.forward(captured.batch, self.cache))
        else:
            captured.graph.replay()
        logits = self.logits[:bucket * q]
        self.replays += 1
        if batch.uniform_query_len and batch.all_logits:
            return logits[:num_seqs * q].clone()  # the next replay overwrites the graph's output
        wanted = batch.token_rows if batch.all_logits else batch.token_rows.index_select(0, batch.logits_indices)
        return logits.index_select(0, wanted)  # (a tensor of its own)

    def _load(self, static: ForwardBatch, batch: ForwardBatch, num_seqs: int, q: int) -> None:
        """Copy the pass into the graph's inputs; rows past num_seqs become padding, and so do a
        ragged pass's missing tokens (at their row's last position, so that they read only keys
        their sequence holds; their keys go to the reserved block)."""
        tokens, width = num_seqs * q, batch.block_tables.shape[1]
        if batch.uniform_query_len:
            for name in ("input_ids", "positions", "slots"):
                getattr(static, name)[:tokens].copy_(getattr(batch, name))
        else:  # token_rows: each real token's row in the [num_seqs * q] layout
            static.input_ids[:tokens].zero_()
            static.positions[:tokens].copy_((batch.seq_lens - 1).repeat_interleave(q))
            static.slots[:tokens].copy_(self._scratch_slots[:q].repeat(num_seqs))
            for name in ("input_ids", "positions", "slots"):
                getattr(static, name)[:tokens].index_copy_(0, batch.token_rows, getattr(batch, name))
        static.block_tables[:num_seqs, :width].copy_(batch.block_tables)
        static.seq_lens[:num_seqs].copy_(batch.seq_lens)
        if num_seqs < static.seq_lens.shape[0]:
            self._pad(static, num_seqs, q)

    def _pad(self, static: ForwardBatch, first: int, q: int) -> None:
        rows = static.seq_lens.shape[0] - first
        static.input_ids[first * q:].zero_()
        static.positions[first * q:].copy_(self._in_block[:q].repeat(rows))
        static.slots[first * q:].copy_(self._scratch_slots[:q].repeat(rows))
        static.block_tables[first:, 0].fill_(self.scratch_block)
        static.seq_lens[first:].fill_(q)

    def _capture(self, bucket: int, q: int) -> _Captured:
        device = self.model.device

        def zeros(*shape):
            return torch.zeros(*shape, dtype=torch.long, device=device)

        static = ForwardBatch(
            input_ids=zeros(bucket * q), positions=zeros(bucket * q), slots=zeros(bucket * q),
            block_tables=zeros(bucket, self.table_width), kv_start=None, token_index=None,
            token_rows=None, token_seqs=None, query_positions=None, logits_indices=None,
            seq_lens=zeros(bucket), query_start=torch.arange(bucket + 1, device=device) * q, max_query_len=q,
            uniform_query_len=True, all_logits=True, block_size=self.cache.block_size, context_len=q)
        self._pad(static, 0, q)
        graph = None
        if self.capture:
            # Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture.
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self.model.forward(static, self.cache)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.logits[:bucket * q].copy_(self.model.forward(static, self.cache))
        captured = _Captured(static, graph)
        self._captured[(bucket, q)] = captured
        return captured

    @property
    def num_graphs(self) -> int:
        return len(self._captured)
