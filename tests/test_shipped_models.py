"""Fast sanity checks of the shipped toy model pair in ``models/``.

The pair is produced by ``scripts/train_pair.py`` (see ``models/README.md``).
``SPECDEC_MODELS_DIR`` overrides the directory checked (default: ``<repo>/models``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

MODELS = Path(os.environ.get("SPECDEC_MODELS_DIR", Path(__file__).resolve().parents[1] / "models"))
TARGET = MODELS / "target"
DRAFT = MODELS / "draft"
MAX_TOTAL_BYTES = 60 * 1000 * 1000

CODE = (
    "def f(x, *args, **kw):\n"
    "    \"\"\"Doc string.\"\"\"\n"
    "    if x  >=  10:\n"
    "\treturn {'a': [1, 2,   3]}  # tab-indented, trailing spaces   \n"
    "\n\n"
    "    return f'{x!r:>8}' + \"caf\u00e9 \u2192 \u65e5\u672c\"\n"
)


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def tokenizers():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TARGET)), AutoTokenizer.from_pretrained(str(DRAFT))


@pytest.fixture(scope="module")
def models():
    import torch
    from transformers import LlamaForCausalLM

    t = LlamaForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
    d = LlamaForCausalLM.from_pretrained(str(DRAFT), dtype=torch.float32).eval()
    return t, d


@pytest.mark.parametrize("d", [TARGET, DRAFT], ids=["target", "draft"])
def test_layout(d):
    for name in ("config.json", "generation_config.json", "model.safetensors",
                 "tokenizer.json", "tokenizer_config.json"):
        assert (d / name).is_file(), f"missing {d / name}"


def test_total_size():
    total = sum(f.stat().st_size for f in MODELS.rglob("*") if f.is_file())
    assert total <= MAX_TOTAL_BYTES, f"models/ is {total / 1e6:.1f} MB"


def test_configs():
    from transformers import AutoConfig

    tc, dc = AutoConfig.from_pretrained(str(TARGET)), AutoConfig.from_pretrained(str(DRAFT))
    assert tc.model_type == dc.model_type == "llama"
    assert tc.vocab_size == dc.vocab_size
    assert tc.num_key_value_heads < tc.num_attention_heads  # GQA in the target
    assert dc.num_hidden_layers < tc.num_hidden_layers
    for c in (tc, dc):
        assert c.bos_token_id is not None and c.eos_token_id is not None
        assert c.max_position_embeddings >= 1024
    assert (tc.bos_token_id, tc.eos_token_id) == (dc.bos_token_id, dc.eos_token_id)


def test_same_tokenizer(tokenizers):
    tt, dt = tokenizers
    assert (TARGET / "tokenizer.json").read_bytes() == (DRAFT / "tokenizer.json").read_bytes()
    assert tt.get_vocab() == dt.get_vocab()
    assert tt.bos_token == "<|bos|>" and tt.eos_token == "<|eos|>"
    cfg = json.loads((TARGET / "config.json").read_text())
    assert tt.convert_tokens_to_ids("<|bos|>") == cfg["bos_token_id"]
    assert tt.convert_tokens_to_ids("<|eos|>") == cfg["eos_token_id"]
    assert len(tt) == cfg["vocab_size"]


def test_tokenizer_round_trip(tokenizers):
    tok = tokenizers[0]
    ids = tok.encode(CODE, add_special_tokens=False)
    assert tok.decode(ids) == CODE
    assert len(ids) < len(CODE)  # BPE actually merges something
    assert tok.decode(tok.encode("x", add_special_tokens=False)) == "x"


def test_weights_and_param_ratio(models, tokenizers):
    import torch

    t, d = models
    pt, pd = _n_params(t), _n_params(d)
    assert pt >= 4 * pd, (pt, pd)
    ids = torch.tensor([tokenizers[0].encode("import os\n", add_special_tokens=False)])
    with torch.no_grad():
        for m in (t, d):
            logits = m(input_ids=ids).logits
            assert logits.shape[-1] == m.config.vocab_size
            assert torch.isfinite(logits).all()


def test_heldout_prompts(tokenizers):
    path = MODELS / "heldout_prompts.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(rows) >= 100
    tok = tokenizers[0]
    for r in rows[:50]:
        n = len(tok.encode(r["prompt"], add_special_tokens=False))
        assert 64 <= n <= 200, n
