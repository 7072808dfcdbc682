"""Random Llama checkpoints in Hugging Face layout, built on the fly for tests."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# Several shapes the runtime must get exactly right. initializer_range is large so logits are
# peaked: greedy comparisons then do not hinge on float rounding between near-equal logits.
CONFIGS: dict[str, dict] = {
    "gqa_untied": dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mha_tied": dict(vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "llama3_rope": dict(vocab_size=280, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=1, tie_word_embeddings=False,
                        rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
}


def build_checkpoint(path: Path, seed: int = 0, max_position_embeddings: int = 256, eos_token_id=None,
                     initializer_range: float = 0.2, **overrides) -> Path:
    torch.manual_seed(seed)
    config = LlamaConfig(max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
                         bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None, **overrides)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return path


def perturbed_copy(src: Path, dst: Path, noise: float, seed: int = 1) -> Path:
    """A draft that agrees with the target often but not always (exercises both paths)."""
    model = LlamaForCausalLM.from_pretrained(src).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp_min(1e-3))
    model.save_pretrained(dst)
    return dst


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()
