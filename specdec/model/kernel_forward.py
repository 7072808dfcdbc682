"""The forward pass in specdec's C kernels (specdec.model.cpu_kernels): every float32 CPU pass.

Same math as Model.forward's torch path, in a fixed order: each token's hidden states, K/V and
logits are computed by the same chain of operations whatever pass it is in (a prompt, a decode
step, a verify pass, a batch with other sequences, any thread count), so a request's tokens never
depend on how it was scheduled (README, "Same tokens wherever served"). Per layer: four products
(over the weights' column panels, floats or codes) and four small ops (norms with the residual add,
rotary + head norms + KV writes, attention over the paged cache, SiLU * up), all in one C call for
the whole pass (cpu_kernels.c, decoder_layers), then the LM head. The residual stream x is
updated in place: each norm first adds the previous block's output to it.
"""
from __future__ import annotations

import torch

from specdec.kv_cache import PagedKVCache
from specdec.model.batch import ForwardBatch


def kernel_forward_fits(batch: ForwardBatch, max_positions: int) -> bool:
    """Whether this path can run `batch`: every position inside the rotary table, which the C
    kernels read unchecked (torch's lookup raises the clear error instead)."""
    return batch.context_len <= max_positions


@torch.inference_mode()
def kernel_forward(model, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
    """Model.forward for a float32 CPU model with kernels loaded; returns float32 logits [M, V]."""
    c, w, kernels = model.config, model.weights, model.kernels
    x = w.embed_rows(batch.input_ids, kernels)  # [T, hidden] the residual stream (a fresh copy)
    h = kernels.decoder_layers(model.layer_table, w.final_norm, x, c.num_attention_heads, c.num_key_value_heads,
                               c.intermediate_size, c.rms_norm_eps, model.scale, batch.positions, model.rotary.cos,
                               model.rotary.sin, batch.slots, batch.token_seqs, batch.kv_slots, cache.k, cache.v)
    if not batch.all_logits:
        h = h.index_select(0, batch.logits_indices)
    return kernels.matmul(h, w.lm_head.panels, h.new_empty(h.shape[0], c.vocab_size))


@torch.inference_mode()
def kernel_draft_chain(model, cache: PagedKVCache, seq_ids: list[str], feeds: list[list[int]], steps_of: list[int],
                       temperatures: list[float], keys: list[int], widths: list[int]
                       ) -> tuple[list[list[int]], torch.Tensor, torch.Tensor] | None:
    """steps_of[i] (>= 1) passes for sequence seq_ids[i] in one C call: the first feeds feeds[i],
    each later one the pick of the pass before (the argmax where widths[i] is 0, else a draw over
    the widths[i] largest logits at temperatures[i] with DRAFT stream keys[i]), each pick from
    the logits of the sequence's last token: the bits that as many kernel_forward passes and picks
    give. -> (each sequence's picks, ids [S, steps, n], q [S, steps, n] of the sampled ones: a
    pass's top tokens and their q), or None, the cache as it was, where a pass would go past the
    rotary table or a sampled row's logits held a NaN (the caller's own passes then say what to do)."""
    c, w = model.config, model.weights
    lengths = [cache.length(s) for s in seq_ids]
    if max(n + len(f) + s - 1 for n, f, s in zip(lengths, feeds, steps_of)) > model.rotary.cos.shape[0]:
        return None
    chain = None
    try:
        slots = [slot for seq_id, fed, n in zip(seq_ids, feeds, steps_of)
                 for slot in cache.append_slots(seq_id, len(fed) + n - 1)]
        size = cache.block_size  # (each request's row of slots as long as the longest's)
        kv_slots = [b * size + o for table in cache.padded_block_tables(seq_ids) for b in table for o in range(size)]
        chain = model.kernels.draft_chain(
            model.layer_table, w.final_norm, w.lm_head.panels, w.embed, feeds, steps_of, lengths, slots, kv_slots,
            temperatures, keys, widths, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size,
            c.rms_norm_eps, model.scale, model.rotary.cos, model.rotary.sin, cache.k, cache.v)
    finally:
        if chain is None:  # (a failed or NaN chain leaves the cache as it found it)
            for seq_id, length in zip(seq_ids, lengths):
                cache.truncate_to(seq_id, length)
    return chain
