"""A model plus its paged KV cache: the piece both workers drive, one ragged pass at a time."""
from __future__ import annotations

import torch

from specdec.kv_cache import PagedKVCache
from specdec.model.batch import prepare_forward
from specdec.model.llama import LlamaModel


def default_num_blocks(model: LlamaModel, block_size: int, max_cache_bytes: int,
                       max_full_sequences: int = 32) -> int:
    """Room for `max_full_sequences` sequences of the full context, capped by a memory budget
    (the cache is allocated up front, so an oversized default costs real memory)."""
    c = model.config
    bytes_per_block = 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * c.head_dim * model.weights.embed.element_size()
    wanted = max_full_sequences * -(-c.max_position_embeddings // block_size)
    return max(1, min(wanted, max_cache_bytes // bytes_per_block))


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int | None = None, block_size: int = 16,
                 max_cache_bytes: int = 1 << 30):
        self.model = model
        if num_blocks is None:
            num_blocks = default_num_blocks(model, block_size, max_cache_bytes)
        self.cache: PagedKVCache = model.new_kv_cache(num_blocks, block_size)
        self.forward_passes = 0

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.model.config.max_position_embeddings

    def run(self, seq_ids: list[str], new_tokens: list[list[int]], num_logits: list[int]) -> list[torch.Tensor]:
        """Feed new_tokens[i] to sequence i; return its last num_logits[i] logits rows ([n, V])."""
        lengths_before = [self.cache.length(s) for s in seq_ids]
        try:
            batch = prepare_forward(self.cache, seq_ids, new_tokens, num_logits)
            logits = self.model.forward(batch, self.cache)
        except BaseException:
            # Leave the cache as it was so a failed pass (e.g. KV cache full) costs no blocks.
            for seq_id, length in zip(seq_ids, lengths_before):
                self.cache.truncate_to(seq_id, length)
            raise
        self.forward_passes += 1
        return list(logits.split(num_logits))
