"""Random checkpoints shaped like real models, built once and cached, for `specdec bench-step`.

Step times depend on a model's shape, not on its weights, so a random checkpoint of SmolLM2-135M's
shape measures decoding speed as well as the real one would. What a random model cannot do is
copy, which is what makes a "rewrite this paragraph with one word changed" prompt cheap for an
n-gram drafter. So the checkpoint gets one planted behaviour: a bigram table that makes its greedy
answer to COPY_PROMPT the paragraph with one word changed.

How it is planted (Llama layers, every norm weight 1): every layer's o_proj and down_proj are
zero, so the residual stream entering the last MLP is the current token's embedding e_a. For each
(a -> b) of the answer, one unit of the last MLP gets gate and up rows along e_a (unit-length),
and its down column is e_b (unit-length): it outputs ~d along e_b for token a (its gate sees
sqrt(d) after the RMSNorm) and ~0.5 for any other token. With tied embeddings the logits are then
largest for b. The weights still have the full shape and are streamed in full every step (zeros
cost a dense product as much as any other values), so the timing is that of the real shape.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from specdec.config import SHIPPED_TARGET

# Hugging Face LlamaConfig fields of each shape. "tiny" is for quick smoke runs and tests.
SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=2048, rope_theta=100000.0, rms_norm_eps=1e-5),
    "tiny": dict(vocab_size=4096, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                 max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5),
}
SHAPE_VERSION = 1  # bump when the construction changes: cached checkpoints are rebuilt

# No token repeats in the answer (with the shipped code tokenizer), so every token of it has one
# successor in the bigram table.
PARAGRAPH = ("This function returns each value from user input when called with a file path and name "
             "string, then writes output into one new table row using default config options only if the "
             "queue has data left after many old log files. Every worker thread reads its batch size "
             "limit before sending results back through that socket connection; errors raise an exception so "
             "tests can check them quickly")
CHANGED = ("default", "custom")  # the one word the answer changes
COPY_PROMPT = f"Rewrite this paragraph with one word changed ({CHANGED[0]} to {CHANGED[1]}):\n\n{PARAGRAPH}"
COPY_ANSWER = " " + PARAGRAPH.replace(CHANGED[0], CHANGED[1])
# "role: content" lines, then the assistant's turn opened (the shipped tokenizer has no template).
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def copy_messages() -> list[dict]:
    return [{"role": "user", "content": COPY_PROMPT}]


def _plant_copy(model, tokenizer) -> int:
    """Make `model`'s greedy answer to copy_messages() COPY_ANSWER (see the module docstring);
    returns how many bigrams were planted."""
    prompt = tokenizer.apply_chat_template(copy_messages(), add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    answer = tokenizer(COPY_ANSWER, add_special_tokens=False)["input_ids"]
    chain = [int(prompt[-1])] + list(answer)
    successor: dict[int, int] = {}
    for a, b in zip(chain, chain[1:]):
        if successor.setdefault(a, b) != b:
            raise ValueError(f"token {a} has two successors in the copy answer: choose a text without repeats")
    layers = model.model.layers
    if len(successor) > model.config.intermediate_size:
        raise ValueError("the copy answer has more bigrams than the last MLP has units")
    with torch.no_grad():
        unit = model.model.embed_tokens.weight / model.model.embed_tokens.weight.norm(dim=-1, keepdim=True)
        for layer in layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        mlp = layers[-1].mlp
        for j, (a, b) in enumerate(successor.items()):
            mlp.gate_proj.weight[j] = unit[a]
            mlp.up_proj.weight[j] = unit[a]
            mlp.down_proj.weight[:, j] = unit[b]
    return len(successor)


def build_copy_checkpoint(shape: str, cache_dir: Path, seed: int = 0) -> Path:
    """The cached checkpoint of `shape` (SHAPES) with the planted copy behaviour, built on first use
    (Hugging Face layout, the shipped tokenizer with CHAT_TEMPLATE)."""
    import transformers  # deferred: heavy, and only a checkpoint not yet cached needs it
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = Path(cache_dir) / f"{shape}-copy-v{SHAPE_VERSION}-seed{seed}"
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_TARGET)
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPES[shape], initializer_range=0.02, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    _plant_copy(model, tokenizer)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(path)  # only a complete checkpoint is ever found in the cache
    return path
