"""A model plus its paged KV cache: the piece both workers drive, one ragged pass at a time."""
from __future__ import annotations

import torch

from specdec.config import WorkerConfig
from specdec.kv_cache import PagedKVCache, blocks_for_tokens
from specdec.model.batch import TreeNodes, prepare_forward
from specdec.model.cuda_graphs import GraphedPasses, graph_logits_bytes
from specdec.model.decoder import Model, load_model
from specdec.model.kernel_forward import kernel_draft_chain
from specdec.model.memory_budget import CudaMemory, DeviceMemory, accelerator_num_blocks, bytes_per_block

# Without an explicit size the cache holds this many sequences of the model's full context.
DEFAULT_FULL_SEQUENCES = 32


def default_num_blocks(model: Model, block_size: int, max_cache_bytes: int) -> int:
    """Room for DEFAULT_FULL_SEQUENCES sequences of the full context, capped by a memory budget
    (the cache is allocated up front, so an oversized default costs real memory)."""
    wanted = DEFAULT_FULL_SEQUENCES * blocks_for_tokens(model.config.max_position_embeddings, block_size)
    return max(1, min(wanted, max_cache_bytes // bytes_per_block(model, block_size)))


class ModelRunner:
    def __init__(self, model: Model, config: WorkerConfig, memory: DeviceMemory | None = None):
        """`memory`: what sizes the cache on an accelerator (torch.cuda's counters by default)."""
        self.model = model
        device = model.device
        graphed = device.type == "cuda" and model.attention == "triton" and config.cuda_graph_max_batch > 0
        num_blocks = config.kv_cache_blocks
        if num_blocks is None and device.type == "cuda":
            # Graphs keep their logits buffer, and their pool the largest pass's own logits, which the
            # headroom (measured on a prefill chunk: one token's logits a sequence) does not hold.
            graph_logits = 2 * graph_logits_bytes(model.config.vocab_size, config.cuda_graph_max_batch)
            num_blocks = accelerator_num_blocks(
                model, memory or CudaMemory(device), config.kv_block_size, config.kv_memory_fraction,
                config.prefill_chunk_tokens, f"{config.role}.kv_memory_fraction",
                reserved=graph_logits if graphed else 0)
        elif num_blocks is None:
            num_blocks = default_num_blocks(model, config.kv_block_size, config.kv_cache_max_bytes)
        self.cache: PagedKVCache = model.new_kv_cache(num_blocks, config.kv_block_size)
        self.chunk_tokens = config.prefill_chunk_tokens
        self.forward_passes = 0
        self.graphs = None  # model.cuda_graphs: on CUDA with Triton's attention unless turned off
        if graphed:
            self.graphs = GraphedPasses(model, self.cache, config.cuda_graph_max_batch)
            self.graphs.capture_all()

    @staticmethod
    def load(config: WorkerConfig, spec: str) -> ModelRunner:
        """Load the model `spec` names (specdec.model.source) as `config` says (device, dtype,
        threads) with its cache."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        return ModelRunner(load_model(spec, config.device, config.resolved_dtype, config.packed_weights,
                                      config.cpu_kernels, config.weights, config.kv_cache_dtype,
                                      config.auto_float_format), config)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.model.config.max_position_embeddings

    def run(self, seq_ids: list[str], new_tokens: list[list[int]], num_logits: list[int],
            trees: list[TreeNodes | None] | None = None) -> list[torch.Tensor]:
        """Feed new_tokens[i] to sequence i; return its last num_logits[i] logits rows ([n, V]).
        trees[i]: which of them are nodes of a token tree (model.batch.TreeNodes; None: a chain).

        A pass takes at most `chunk_tokens` new tokens in all: more (a long prompt, or several
        prompts at once) are fed in consecutive passes, each sequence's tokens in order, so a
        pass's memory is bounded by the setting (and the accelerator's headroom measured for it,
        memory_budget), not by the prompts. On the C kernels' path the logits are the same bits
        either way (a token's computation does not depend on its pass)."""
        lengths_before = [self.cache.length(s) for s in seq_ids]
        try:
            if sum(map(len, new_tokens)) <= self.chunk_tokens:
                return list(self._pass(seq_ids, new_tokens, num_logits, trees).split_with_sizes(num_logits))
            if trees and any(trees):
                return self._chunked_then_tree(seq_ids, new_tokens, num_logits, trees)
            return self._chunked(seq_ids, new_tokens, num_logits)
        except BaseException:
            # Leave the cache as it was so a failed pass (e.g. KV cache full) costs no blocks.
            for seq_id, length in zip(seq_ids, lengths_before):
                self.cache.truncate_to(seq_id, length)
            raise

    def draft_chain(self, seq_ids: list[str], feeds: list[list[int]], steps_of: list[int],
                    temperatures: list[float], keys: list[int], widths: list[int]
                    ) -> tuple[list[list[int]], torch.Tensor, torch.Tensor] | None:
        """A draft's passes in one call where the model runs in the C kernels and the first pass fits
        one chunk (model.kernel_forward.kernel_draft_chain: the same bits as a pass and a pick
        each); None elsewhere, or where that call leaves them to the caller's own passes."""
        if self.model.kernels is None or sum(map(len, feeds)) > self.chunk_tokens:
            return None
        chain = kernel_draft_chain(self.model, self.cache, seq_ids, feeds, steps_of, temperatures, keys, widths)
        self.forward_passes += max(steps_of) if chain is not None else 0
        return chain

    def _pass(self, seq_ids: list[str], new_tokens: list[list[int]], num_logits: list[int],
              trees: list[TreeNodes | None] | None = None) -> torch.Tensor:
        batch = prepare_forward(self.cache, seq_ids, new_tokens, num_logits, trees)
        logits = self.graphs.forward(batch) if self.graphs else self.model.forward(batch, self.cache)
        self.forward_passes += 1
        return logits

    def _chunked_then_tree(self, seq_ids: list[str], new_tokens: list[list[int]], num_logits: list[int],
                           trees: list[TreeNodes | None]) -> list[torch.Tensor]:
        """A pass too long for one chunk: the causal tokens in chunks, then the tree nodes in one
        pass of their own (a tree is a round's few proposed tokens, after a long prompt)."""
        nodes = [len(tree.paths) if tree else 0 for tree in trees]
        causal = [tokens[:len(tokens) - n] for tokens, n in zip(new_tokens, nodes)]
        causal_logits = [max(0, wanted - n) for wanted, n in zip(num_logits, nodes)]
        fed = [i for i, tokens in enumerate(causal) if tokens]
        rows = [[] for _ in seq_ids]
        for i, part in zip(fed, self._chunked([seq_ids[i] for i in fed], [causal[i] for i in fed],
                                              [causal_logits[i] for i in fed])):
            rows[i].append(part)
        grown = [i for i, n in enumerate(nodes) if n]
        node_logits = [min(num_logits[i], nodes[i]) for i in grown]
        tree_pass = self._pass([seq_ids[i] for i in grown], [new_tokens[i][-nodes[i]:] for i in grown], node_logits,
                               [trees[i] for i in grown])
        for i, part in zip(grown, tree_pass.split(node_logits)):
            rows[i].append(part)
        return [torch.cat(parts) for parts in rows]

    def _chunked(self, seq_ids: list[str], new_tokens: list[list[int]], num_logits: list[int]) -> list[torch.Tensor]:
        rows: list[list[torch.Tensor]] = [[] for _ in seq_ids]
        fed = [0] * len(seq_ids)  # tokens of each sequence already in the cache
        while True:
            room, active, pieces = self.chunk_tokens, [], []
            for i, tokens in enumerate(new_tokens):
                take = min(len(tokens) - fed[i], room)
                if take > 0:
                    active.append(i)
                    pieces.append(tokens[fed[i]:fed[i] + take])
                    room -= take
            if not active:
                return [torch.cat(parts) for parts in rows]
            # The rows asked for are a suffix of the sequence's new tokens: the part of it in this
            # piece is a suffix of the piece.
            wanted = [max(0, fed[i] + len(piece) - max(fed[i], len(new_tokens[i]) - num_logits[i]))
                      for i, piece in zip(active, pieces)]
            logits = self._pass([seq_ids[i] for i in active], pieces, wanted)
            for i, piece, part in zip(active, pieces, logits.split(wanted)):
                rows[i].append(part)
                fed[i] += len(piece)
