"""Turn a checkpoint's tensors (Hugging Face names, whatever the source) into fused, inference-ready
tensors.

Projection matrices are stored [in, out] (`x @ w`): on CPU a skinny product (one to a few dozen
rows, as in decoding and verifying) runs about a third faster against a contiguous [in, out]
matrix than against the checkpoint's [out, in] one (`F.linear`); on GPU it makes no difference.
A tied LM head is a transposed view of the embedding on GPU (no second copy); on CPU it gets a
contiguous copy, since the one-row product against the view runs up to twice as slow.
With `packed` (CPU only) every projection, the LM head included, also keeps a oneDNN-packed copy
for products of several rows (specdec.model.linear). With `kernels` (specdec's C kernels, a float32
CPU model) every projection keeps the C kernels' panels instead, which every pass then uses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.model.config import ModelConfig
from specdec.model.linear import Projection, onednn_available


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Projection  # hidden -> (H + 2 Hkv) * D: one product instead of three
    qk_norm: torch.Tensor | None  # [H + Hkv, D]: q_norm's weight on each q head, then k_norm's (Qwen3)
    o_proj: Projection  # H * D -> hidden
    post_norm: torch.Tensor
    gate_up: Projection  # hidden -> 2 * intermediate
    down: Projection  # intermediate -> hidden


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Projection  # hidden -> vocab; tied on GPU: its weight is a view of embed
    tied: bool  # the LM head is the embedding
    num_parameters: int  # of the checkpoint (a tied head and the stacked q/k norms counted once)


def build_weights(config: ModelConfig, raw: dict[str, torch.Tensor], device: torch.device | str,
                  dtype: torch.dtype, packed: bool = True, kernels=None) -> ModelWeights:
    """raw: tensors by Hugging Face name (with or without the `model.` prefix), [out, in] matrices.
    packed: also keep oneDNN-packed copies for multi-row products where oneDNN can (CPU, float32).
    kernels: model.cpu_kernels.CpuKernels; every projection then keeps its panels (and no
    oneDNN copy: the kernel pass never uses one)."""
    counted = 0
    packed = packed and kernels is None and onednn_available(torch.device(device), dtype)

    def product(weight: torch.Tensor, bias: torch.Tensor | None) -> Projection:
        panels = kernels.pack(weight, bias) if kernels is not None else None
        return Projection(weight, bias, packed, panels)

    def take(name: str) -> torch.Tensor:
        nonlocal counted
        for key in (name, f"model.{name}"):
            if key in raw:
                counted += raw[key].numel()
                return raw[key].to(device=device, dtype=dtype)
        raise KeyError(f"checkpoint is missing tensor {name!r}")

    def in_out(*names: str) -> torch.Tensor:
        """The checkpoint's [out, in] matrices, stacked on out and stored [in, out]."""
        return torch.cat([take(n) for n in names]).t().contiguous()

    def biases(*names: str) -> torch.Tensor:
        return torch.cat([take(n) for n in names])

    def projection(weights: list[str], bias_names: list[str] | None) -> Projection:
        """The checkpoint's [out, in] matrices `weights`, stacked on out (one product for all)."""
        return product(in_out(*weights), biases(*bias_names) if bias_names else None)

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    layers = []
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}"
        attn, mlp = f"{p}.self_attn", f"{p}.mlp"
        qk_norm = None
        if config.qk_norm:
            # One multiply after one weightless RMSNorm over all heads needs the weight per head.
            q_norm, k_norm = take(f"{attn}.q_norm.weight"), take(f"{attn}.k_norm.weight")
            qk_norm = torch.cat([q_norm.expand(heads, -1), k_norm.expand(kv_heads, -1)]).contiguous()
        layers.append(LayerWeights(
            input_norm=take(f"{p}.input_layernorm.weight"),
            qkv=projection([f"{attn}.{n}_proj.weight" for n in "qkv"],
                           [f"{attn}.{n}_proj.bias" for n in "qkv"] if config.qkv_bias else None),
            qk_norm=qk_norm,
            o_proj=projection([f"{attn}.o_proj.weight"], [f"{attn}.o_proj.bias"] if config.o_bias else None),
            post_norm=take(f"{p}.post_attention_layernorm.weight"),
            gate_up=projection([f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"],
                               [f"{mlp}.gate_proj.bias", f"{mlp}.up_proj.bias"] if config.mlp_bias else None),
            down=projection([f"{mlp}.down_proj.weight"], [f"{mlp}.down_proj.bias"] if config.mlp_bias else None),
        ))
    embed = take("embed_tokens.weight")
    tied = config.tie_word_embeddings or not any(k in raw for k in ("lm_head.weight", "model.lm_head.weight"))
    if tied:
        lm_head = product(embed.t().contiguous() if torch.device(device).type == "cpu" else embed.t(), None)
    else:
        lm_head = projection(["lm_head.weight"], None)
    final_norm = take("norm.weight")
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head, tied=tied,
                        num_parameters=counted)
