"""A lean Llama-family forward pass over a paged KV cache.

Hugging Face's modules are built for training and generality; per decode step they cost several
milliseconds of Python on a CPU. This runtime keeps only what inference needs: fused QKV and
gate/up products against [in, out] weights, a precomputed rotary table applied to q and k at once,
one attention mask per pass, K/V written straight into cache blocks, and logits computed only for
the positions the caller asks for. Each eager op costs ~10-30 us of framework time on a small CPU,
so op count matters as much as FLOPs for the draft model.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.kv_cache import PagedKVCache
from specdec.model.attention import attention_mask, paged_attention, write_kv
from specdec.model.batch import ForwardBatch
from specdec.model.config import LlamaConfig
from specdec.model.rope import RotaryTable
from specdec.model.weights import ModelWeights, build_weights, read_safetensors

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), normalised in float32 like the reference whatever the storage dtype
    (F.rms_norm gives bit-identical float32 results in one op instead of five)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight (+ bias), weight stored [in, out] (see specdec.model.weights)."""
    return x @ weight if bias is None else torch.addmm(bias, x, weight)


class LlamaModel:
    def __init__(self, config: LlamaConfig, weights: ModelWeights, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.config = config
        self.weights = weights
        self.device = torch.device(device)
        self.dtype = dtype
        self.rotary = RotaryTable(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                  config.rope_scaling, self.device, dtype)
        self.scale = config.head_dim ** -0.5
        self._q_size = config.num_attention_heads * config.head_dim
        self._kv_size = config.num_key_value_heads * config.head_dim

    @staticmethod
    def load(path: str | Path, device: str = "cpu", dtype: str | torch.dtype = "float32") -> LlamaModel:
        torch_dtype = resolve_dtype(dtype)
        if torch.device(device).type == "cpu" and torch_dtype != torch.float32:
            raise ValueError("on CPU specdec runs float32 only; use bfloat16/float16 on a GPU")
        config = LlamaConfig.from_dir(path)
        weights = build_weights(config, read_safetensors(path), device, torch_dtype)
        return LlamaModel(config, weights, device, torch_dtype)

    @property
    def num_parameters(self) -> int:
        w = self.weights
        total = w.embed.numel() + w.final_norm.numel()
        if not w.tied:  # a matrix of its own (a tied head's copy holds no new parameters)
            total += w.lm_head.numel()
        for layer in w.layers:
            total += sum(t.numel() for t in vars(layer).values() if t is not None)
        return total

    def new_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        c = self.config
        return PagedKVCache(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads,
                            c.head_dim, self.device, self.dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """Run the new tokens of `batch` (already given slots in `cache`); return float32 logits
        [M, vocab] for batch.logits_indices."""
        c = self.config
        x = self.weights.embed[batch.input_ids]
        num_tokens = x.shape[0]
        heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
        cos, sin = self.rotary.lookup(batch.positions)
        mask = attention_mask(batch)  # the same for every layer
        for index, layer in enumerate(self.weights.layers):
            h = rms_norm(x, layer.input_norm, c.rms_norm_eps)
            qkv = project(h, layer.qkv, layer.qkv_bias)
            # q and k sit side by side in qkv: one rotation serves both.
            qk = self.rotary.apply(qkv[:, :self._q_size + self._kv_size].view(num_tokens, heads + kv_heads,
                                                                                c.head_dim), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, self._q_size + self._kv_size:].view(num_tokens, kv_heads, c.head_dim)
            write_kv(cache.k[index], cache.v[index], k, v, batch.slots)
            attn = paged_attention(q, cache.k[index], cache.v[index], batch, mask, self.scale)
            x = x + project(attn.reshape(num_tokens, -1), layer.o_proj, layer.o_bias)
            h = rms_norm(x, layer.post_norm, c.rms_norm_eps)
            gate, up = project(h, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            x = x + project(F.silu(gate) * up, layer.down, layer.down_bias)
        x = rms_norm(x[batch.logits_indices], self.weights.final_norm, c.rms_norm_eps)
        return (x @ self.weights.lm_head).float()
