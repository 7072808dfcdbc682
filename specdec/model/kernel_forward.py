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
