"""Llama-family configuration read from a Hugging Face `config.json`."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class LlamaConfig:
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
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @staticmethod
    def from_dict(raw: dict) -> LlamaConfig:
        archs = raw.get("architectures") or []
        model_type = raw.get("model_type", "llama")
        if model_type != "llama" and not any("Llama" in a for a in archs):
            raise ValueError(f"unsupported model_type {model_type!r}: specdec runs Llama-family checkpoints")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw.get('hidden_act')!r} (Llama uses silu)")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_scaling = raw.get("rope_scaling")
        # transformers >= 5 may store rope settings under `rope_parameters`.
        rope_params = raw.get("rope_parameters") or {}
        rope_theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        if rope_scaling is None and rope_params.get("rope_type", "default") not in ("default", None):
            rope_scaling = dict(rope_params)
        return LlamaConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @staticmethod
    def from_dir(path: str | Path) -> LlamaConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in {path}: expected a Hugging Face checkpoint directory")
        return LlamaConfig.from_dict(json.loads(config_path.read_text()))
