"""Load Hugging Face Llama safetensors into fused, inference-ready tensors.

Projection matrices are stored [in, out] (`x @ w`): on CPU a skinny product (one to a few dozen
rows, as in decoding and verifying) runs about a third faster against a contiguous [in, out]
matrix than against the checkpoint's [out, in] one (`F.linear`); on GPU it makes no difference.
A tied LM head is a transposed view of the embedding on GPU (no second copy); on CPU it gets a
contiguous copy, since the one-row product against the view runs up to twice as slow.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from specdec.model.config import LlamaConfig


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [hidden, (H + 2 Hkv) * D]: one product instead of three
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor  # [H * D, hidden]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [hidden, 2 * intermediate]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [intermediate, hidden]
    down_bias: torch.Tensor | None


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [hidden, vocab]; tied on GPU: a view of embed
    tied: bool  # the LM head is the embedding (so counted once)


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def build_weights(config: LlamaConfig, raw: dict[str, torch.Tensor], device: torch.device | str,
                  dtype: torch.dtype) -> ModelWeights:
    def take(name: str) -> torch.Tensor:
        for key in (name, f"model.{name}"):
            if key in raw:
                return raw[key].to(device=device, dtype=dtype)
        raise KeyError(f"checkpoint is missing tensor {name!r}")

    def maybe(name: str) -> torch.Tensor | None:
        try:
            return take(name)
        except KeyError:
            return None

    def cat_optional(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if any(p is None for p in parts) else torch.cat(parts)  # type: ignore[arg-type]

    def in_out(*names: str) -> torch.Tensor:
        """The checkpoint's [out, in] matrices, stacked on out and stored [in, out]."""
        return torch.cat([take(n) for n in names]).t().contiguous()

    layers = []
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}"
        attn, mlp = f"{p}.self_attn", f"{p}.mlp"
        layers.append(LayerWeights(
            input_norm=take(f"{p}.input_layernorm.weight"),
            qkv=in_out(f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"),
            qkv_bias=cat_optional([maybe(f"{attn}.{n}_proj.bias") for n in "qkv"]) if config.attention_bias else None,
            o_proj=in_out(f"{attn}.o_proj.weight"),
            o_bias=maybe(f"{attn}.o_proj.bias") if config.attention_bias else None,
            post_norm=take(f"{p}.post_attention_layernorm.weight"),
            gate_up=in_out(f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"),
            gate_up_bias=(cat_optional([maybe(f"{mlp}.gate_proj.bias"), maybe(f"{mlp}.up_proj.bias")])
                          if config.mlp_bias else None),
            down=in_out(f"{mlp}.down_proj.weight"),
            down_bias=maybe(f"{mlp}.down_proj.bias") if config.mlp_bias else None,
        ))
    embed = take("embed_tokens.weight")
    tied = config.tie_word_embeddings or not any(k in raw for k in ("lm_head.weight", "model.lm_head.weight"))
    if tied:
        lm_head = embed.t().contiguous() if torch.device(device).type == "cpu" else embed.t()
    else:
        lm_head = in_out("lm_head.weight")
    return ModelWeights(embed=embed, layers=layers, final_norm=take("norm.weight"), lm_head=lm_head, tied=tied)
