"""The forward pass on a GPU: four products per layer (cuBLAS, through torch) and four Triton
kernels (model.triton_ops: norm with the residual add, rotary with the K/V writes, attention over
the paged cache, SiLU * up). Same math as Model.forward's torch path; used where Triton runs the
attention (model.decoder.attention_backend) and the layers have no per-head q/k norms (Qwen3's
run the torch path with Triton's attention). No op here reads a value back to the host, so a pass
can be captured in a CUDA graph (model.cuda_graphs).
"""
from __future__ import annotations

import torch

from specdec.kv_cache import PagedKVCache
from specdec.model.batch import ForwardBatch
from specdec.model.triton_attention import triton_paged_attention
from specdec.model.triton_ops import add_rms_norm, rope_and_cache, silu_mul


@torch.inference_mode()
def gpu_forward(model, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
    """Model.forward on the fused kernels; returns float32 logits [M, vocab]."""
    c, w = model.config, model.weights
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    x = w.embed_rows(batch.input_ids)  # [T, hidden] the residual stream (a fresh tensor, added to in place)
    tokens = x.shape[0]
    delta = None  # the previous block's output, added to x by the next norm
    for index, layer in enumerate(w.layers):
        h = add_rms_norm(x, delta, layer.input_norm, c.rms_norm_eps)
        qkv = layer.qkv(h)
        q = rope_and_cache(qkv, model.rotary.cos, model.rotary.sin, batch.positions, batch.slots, cache.k[index],
                           cache.v[index], heads, kv_heads)  # [T, H, D]
        attn = triton_paged_attention(q, cache.k[index], cache.v[index], batch.block_tables, batch.seq_lens,
                                      batch.query_start, batch.positions, batch.max_query_len, model.scale)
        delta = layer.o_proj(attn.view(tokens, -1))
        h = add_rms_norm(x, delta, layer.post_norm, c.rms_norm_eps)
        delta = layer.down(silu_mul(layer.gate_up(h)))
    h = add_rms_norm(x, delta, w.final_norm, c.rms_norm_eps)
    if not batch.all_logits:
        h = h.index_select(0, batch.logits_indices)
    return w.lm_head(h).float()
