"""The configuration of a decoder of the Llama family of architectures, read from a Hugging Face
`config.json` (as a dict: a GGUF file's metadata is translated into the same fields first).

A *family* is one of the Hugging Face architectures this runtime computes exactly. They share one
forward pass (RMSNorm, rotary attention with grouped K/V heads, SwiGLU) and differ only in a few
switches, which `ModelConfig` carries:

| family  | q/k/v bias      | o_proj bias     | q/k RMSNorm | notes                                    |
|---------|-----------------|-----------------|-------------|------------------------------------------|
| llama   | attention_bias  | attention_bias  | no          | mlp_bias; rope_scaling linear or llama3  |
| mistral | no              | no              | no          | sliding_window must cover the context    |
| qwen2   | always          | no              | no          | sliding window only if use_sliding_window |
| qwen3   | attention_bias  | attention_bias  | per head    | head_dim may differ from hidden / heads  |
"""
from __future__ import annotations

from dataclasses import dataclass, field

# model_type -> the `architectures` entry Hugging Face writes for it.
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def model_family(raw: dict) -> str:
    """The family a config.json describes: its model_type, else its architectures; ValueError
    naming what it is and the supported families when it is none of them."""
    model_type = raw.get("model_type")
    if model_type in FAMILIES:
        return model_type
    archs = raw.get("architectures") or []
    for family, arch in FAMILIES.items():
        if arch in archs:
            return family
    named = model_type or (", ".join(archs) if archs else "unknown (config.json has no model_type)")
    raise ValueError(f"unsupported model family {named!r}: specdec runs {', '.join(FAMILIES)} "
                     f"({', '.join(FAMILIES.values())})")


def sliding_window(raw: dict, family: str) -> int | None:
    """The attention window of any layer that uses one, or None when every layer sees its whole
    context. Mistral slides whenever `sliding_window` is set; Qwen2/Qwen3 only with
    `use_sliding_window` (their configs carry a window even when it is off), on the layers that
    `layer_types` (or, in older configs, max_window_layers) marks."""
    window = raw.get("sliding_window")
    if window is None:
        return None
    if family == "mistral":
        return int(window)
    if family in ("qwen2", "qwen3"):
        if not raw.get("use_sliding_window", False):
            return None
        layer_types = raw.get("layer_types")
        if layer_types is not None:
            return int(window) if "sliding_attention" in layer_types else None
        slides = int(raw.get("max_window_layers", 0)) < int(raw["num_hidden_layers"])
        return int(window) if slides else None
    return None


@dataclass(frozen=True)
class ModelConfig:
    family: str  # a key of FAMILIES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q_proj, k_proj and v_proj add a bias
    o_bias: bool = False  # o_proj adds a bias
    mlp_bias: bool = False  # gate_proj, up_proj and down_proj add a bias
    qk_norm: bool = False  # RMSNorm over head_dim on every q and k head, before the rotation (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @staticmethod
    def from_dict(raw: dict) -> ModelConfig:
        family = model_family(raw)
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw.get('hidden_act')!r} ({family} uses silu)")
        context = int(raw.get("max_position_embeddings", 2048))
        window = sliding_window(raw, family)
        if window is not None and window < context:
            raise ValueError(f"sliding-window attention (window {window} < context {context}) is not supported yet")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_scaling = raw.get("rope_scaling")
        # transformers >= 5 may store rope settings under `rope_parameters`.
        rope_params = raw.get("rope_parameters") or {}
        rope_theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        if rope_scaling is None and rope_params.get("rope_type", "default") not in ("default", None):
            rope_scaling = dict(rope_params)
        attention_bias = bool(raw.get("attention_bias", False))
        return ModelConfig(
            family=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=context,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias={"llama": attention_bias, "mistral": False, "qwen2": True, "qwen3": attention_bias}[family],
            o_bias=attention_bias and family in ("llama", "qwen3"),
            mlp_bias=bool(raw.get("mlp_bias", False)) and family == "llama",
            qk_norm=family == "qwen3",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
