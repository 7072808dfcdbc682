"""The round-loop tests' fixtures: a small random target with no EOS (module-scoped, overriding
the session-wide parametrized `target_dir`), and target-only reference outputs."""
from __future__ import annotations

import pytest
import torch
import transformers

from specdec import SamplingParams

from round_helpers import MAX_POS, VOCAB, _engine, _write_config


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(99)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS,
                                   initializer_range=0.2)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def target_dir(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("sched_target")
    hf_model.save_pretrained(path)
    _write_config(path, eos_token_id=None)  # no EOS unless a test asks for one
    return path


@pytest.fixture(scope="module")
def reference(target_dir):
    """Target-only greedy outputs (plain decoding), cached per (prompt, max_new_tokens)."""
    engine = _engine(target_dir)
    cache = {}

    def get(prompt, n):
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = engine.generate([prompt], SamplingParams(max_new_tokens=n))[0].token_ids
        return cache[key]

    return get
