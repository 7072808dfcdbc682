"""Models load from every source through one resolver: a checkpoint directory, a .gguf file (F32,
F16, BF16 and quantized weights, tokenizer and chat template from its metadata) and a Hub id found
in the local cache. Each GGUF runs exactly like transformers on the same (dequantized) weights;
specs that name no model fail with errors that say what is accepted."""
from __future__ import annotations

import argparse
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdec import LocalEngine, SamplingParams
from specdec.model import ModelSourceError, load_model, resolve_model_source
from specdec.model.gguf_file import unpermute_rows
from specdec.model.quantized import QuantizedMatrix
from specdec.tokenizer import load_tokenizer
from specdec_app.bench.arguments import model_problem
from specdec_app.bench.hf_runner import load_hf
from specdec_app.flags import SERVE_SETTINGS, add_settings
from specdec_app.serve import ServeError, build_config

from checkpoints import CONFIGS, FAMILY_CONFIGS, build_checkpoint, hf_greedy
from gguf_files import llama_cpp_permute, write_gguf

PROMPTS = [[3, 17, 42, 7, 99, 12, 5], [8, 8, 8, 21, 30, 8, 8, 8, 21], list(range(40, 72))]
NEW_TOKENS = 16
# Row sizes that are a multiple of 256, so that the K-quants (256-number blocks) apply to every matrix.
K_QUANT_SHAPE = dict(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
# (checkpoint shape, tensor types written): Llama with GQA (q/k rows permuted in the file), with
# attention and MLP biases (the q/k biases permuted too), with Llama 3 rope scaling (rope_freqs);
# Qwen2 with biases; Qwen3 (q/k norms, head_dim != hidden / heads, tied).
GGUF_CASES = {
    "llama_gqa": (CONFIGS["gqa_untied"], ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]),
    "llama_biases": ({**CONFIGS["gqa_untied"], "attention_bias": True, "mlp_bias": True}, ["F32", "Q8_0"]),
    "llama3_rope": (CONFIGS["llama3_rope"], ["F32", "Q8_0"]),
    "qwen2_biases": (FAMILY_CONFIGS["qwen2_untied"], ["F32", "F16", "Q8_0", "Q4_0"]),
    "qwen3_tied": (FAMILY_CONFIGS["qwen3_tied"], ["F32", "Q8_0", "Q4_1"]),
    "llama_k_quants": (K_QUANT_SHAPE, ["Q4_K", "Q6_K"]),
}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
          "The quick brown fox jumps over the lazy dog. Speculative decoding keeps the target's output.",
          "hello world, hello tokenizer; numbers 12345 and 67890"] * 10


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    return {name: build_checkpoint(tmp_path_factory.mktemp(f"src-{name}"), seed=0, **shape)
            for name, (shape, _) in GGUF_CASES.items()}


@pytest.fixture(scope="module")
def gguf_files(hf_checkpoints, tmp_path_factory):
    """(name, tensor type) -> (the .gguf file, its reference checkpoint directory)."""
    out = {}
    for name, (_, types) in GGUF_CASES.items():
        for tensor_type in types:
            where = tmp_path_factory.mktemp(f"gguf-{name}-{tensor_type}")
            out[name, tensor_type] = (write_gguf(hf_checkpoints[name], where / "model.gguf", where / "reference",
                                                 tensor_type), where / "reference")
    return out


ALL_GGUF = [(name, t) for name, (_, types) in GGUF_CASES.items() for t in types]


@pytest.mark.parametrize("name,tensor_type", ALL_GGUF)
def test_gguf_tensors_are_the_reference_weights(gguf_files, name, tensor_type):
    """Name mapping, q/k row order and dequantization, checked exactly against the weights written."""
    path, reference = gguf_files[name, tensor_type]
    source = resolve_model_source(str(path))
    assert source.kind == "gguf"
    ours = source.tensors(torch.float32)
    expected = load_file(str(reference / "model.safetensors"))
    assert sorted(ours) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(ours[key], value), key
    if tensor_type != "F32":  # the file really holds that type
        types = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
        assert tensor_type in types


@pytest.mark.parametrize("name,tensor_type", ALL_GGUF)
def test_gguf_greedy_matches_transformers_on_the_same_weights(gguf_files, name, tensor_type):
    """With float weights (`weights fp`) a GGUF runs as its dequantized reference does in transformers."""
    path, reference = gguf_files[name, tensor_type]
    engine = LocalEngine(str(path), draft="ngram", num_speculative_tokens=3, kv_block_size=8, adaptive=False,
                         target_weights="fp")
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outputs] == [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("name,tensor_type", [c for c in ALL_GGUF if c[1].startswith("Q")])
def test_quantized_gguf_keeps_its_codes(gguf_files, name, tensor_type):
    """By default a quantized GGUF is held as codes: Q8_0, Q4_0 and Q4_1 exactly the file's numbers,
    other types at the nearest format; each projection's bytes are a fraction of the floats'."""
    path, reference = gguf_files[name, tensor_type]
    kept = resolve_model_source(str(path)).tensors(torch.float32, keep_quantized=True)
    expected = load_file(str(reference / "model.safetensors"))
    for key, value in expected.items():
        if value.dim() == 2 and value.shape[1] % 32 == 0:
            matrix = kept[key]
            assert isinstance(matrix, QuantizedMatrix), key
            if tensor_type in ("Q8_0", "Q4_0", "Q4_1"):
                assert torch.equal(matrix.dequantize(), value), key
            else:
                assert matrix.bits == (8 if tensor_type == "Q6_K" else 4)
                scale = value.abs().amax()
                assert (matrix.dequantize() - value).abs().amax() <= scale / (14 if matrix.bits == 4 else 200), key
    model = load_model(path)
    assert model.quantized
    for projection in model.weights.layers[0].projections():  # the file's float matrices stay floats
        assert (projection.weight is None) == (projection.in_features % 32 == 0)
        if projection.weight is None:  # bits / 8 bytes a number (in 64-column panels), one byte never widened
            panels = projection.panels
            padded_columns = -(-projection.out_features // 64) * 64
            assert panels.codes.numel() * 8 == projection.in_features * padded_columns * panels.bits


@pytest.mark.parametrize("name,tensor_type", [("llama_gqa", "Q4_1"), ("qwen3_tied", "Q8_0"), ("qwen2_biases", "Q4_0"),
                                              ("llama_k_quants", "Q4_K")])
def test_quantized_gguf_speculation_equals_its_own_plain_decoding(gguf_files, name, tensor_type):
    """Held as codes, the model differs from the float reference, but speculative output is still
    exactly what plain decoding of the same codes gives (n-gram drafts and the GGUF drafting itself)."""
    path, _ = gguf_files[name, tensor_type]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    plain = LocalEngine(str(path), draft=None, kv_block_size=8).generate(PROMPTS, params)
    for draft in ("ngram", str(path)):
        engine = LocalEngine(str(path), draft=draft, num_speculative_tokens=3, kv_block_size=8, adaptive=False)
        assert [o.token_ids for o in engine.generate(PROMPTS, params)] == [o.token_ids for o in plain]


def test_gguf_config_matches_the_checkpoint(gguf_files, hf_checkpoints):
    from specdec.model import ModelConfig

    for name in ("llama_gqa", "qwen2_biases", "qwen3_tied"):
        path, _ = gguf_files[name, "F32"]
        ours = ModelConfig.from_dict(resolve_model_source(str(path)).config)
        direct = ModelConfig.from_dict(resolve_model_source(str(hf_checkpoints[name])).config)
        assert ours == direct
    # Llama 3 scaling arrives as per-frequency factors and gives the same rotation (to float32 rounding).
    scaled = load_model(gguf_files["llama3_rope", "F32"][0])
    assert scaled.config.rope_scaling["rope_type"] == "frequency_factors"
    direct = load_model(hf_checkpoints["llama3_rope"])
    torch.testing.assert_close(scaled.rotary.cos, direct.rotary.cos, atol=1e-5, rtol=0)


def test_a_draft_from_a_gguf_file(gguf_files, hf_checkpoints):
    """A quantized GGUF drafting for the checkpoint it was made from: output exactly the target's."""
    target = hf_checkpoints["llama_gqa"]
    engine = LocalEngine(str(target), draft=str(gguf_files["llama_gqa", "Q4_0"][0]), num_speculative_tokens=4,
                         kv_block_size=8, adaptive=False)
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outputs] == [hf_greedy(target, p, NEW_TOKENS) for p in PROMPTS]
    assert sum(o.stats.accepted_tokens for o in outputs) > 0


def test_unpermute_inverts_llama_cpp_permute():
    rows = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)  # 4 heads of head_dim 8
    permuted = torch.from_numpy(llama_cpp_permute(rows, 4))
    assert not torch.equal(permuted, torch.from_numpy(rows))
    assert torch.equal(unpermute_rows(permuted, 4), torch.from_numpy(rows))


# ---------------------------------------------------------------- tokenizer and chat template in a GGUF

@pytest.fixture(scope="module")
def hf_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def gguf_with_tokenizer(hf_tokenizer, tmp_path_factory):
    where = tmp_path_factory.mktemp("gguf-tokenizer")
    shape = {**FAMILY_CONFIGS["qwen2_untied"], "vocab_size": len(hf_tokenizer)}
    checkpoint = build_checkpoint(where / "hf", seed=2, **shape)
    path = write_gguf(checkpoint, where / "chat.gguf", where / "reference", "Q8_0", tokenizer=hf_tokenizer,
                      chat_template=CHATML)
    return path, where / "reference"


TEXTS = ["hello world", "def fibonacci(n):\n    return n", "  spaces,\ttabs and ünïcode ☃\n\n",
         "<|im_start|>user\nhi<|im_end|>"]


def test_gguf_tokenizer_and_chat_template(gguf_with_tokenizer, hf_tokenizer):
    path, _ = gguf_with_tokenizer
    tokenizer = load_tokenizer(path)
    assert tokenizer is not None
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == hf_tokenizer(text)["input_ids"], text
        assert tokenizer.decode(ids) == text
    assert tokenizer.chat_template == CHATML == resolve_model_source(str(path)).chat_template
    messages = [{"role": "user", "content": "hello world"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"
    config = resolve_model_source(str(path)).config
    assert config["eos_token_id"] == [hf_tokenizer.eos_token_id]


def test_text_prompts_through_a_gguf(gguf_with_tokenizer, hf_tokenizer):
    path, reference = gguf_with_tokenizer
    engine = LocalEngine(str(path), draft="ngram", num_speculative_tokens=3, adaptive=False)
    [out] = engine.generate(["def fibonacci(n):"], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert out.token_ids == hf_greedy(reference, hf_tokenizer("def fibonacci(n):")["input_ids"], NEW_TOKENS)
    assert out.text == hf_tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_gguf_without_tokenizer(gguf_files):
    path, _ = gguf_files["llama_gqa", "F32"]
    assert load_tokenizer(path) is None
    assert resolve_model_source(str(path)).chat_template is None
    engine = LocalEngine(str(path), draft=None)
    with pytest.raises(ValueError, match="token ids"):
        engine.generate(["text"], SamplingParams(max_new_tokens=2))


def test_hf_directory_tokenizer_and_chat_template(hf_tokenizer, tmp_path):
    hf_tokenizer.chat_template = CHATML
    hf_tokenizer.save_pretrained(tmp_path)
    build_checkpoint(tmp_path, seed=0, **{**CONFIGS["gqa_untied"], "vocab_size": len(hf_tokenizer)})
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer(TEXTS[1])["input_ids"] == hf_tokenizer(TEXTS[1])["input_ids"]
    assert tokenizer.chat_template == CHATML == resolve_model_source(str(tmp_path)).chat_template


def test_unsupported_gguf_architecture(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gemma2': specdec runs llama, qwen2, qwen3"):
        load_model(tmp_path / "gemma.gguf")


# ---------------------------------------------------------------- Hub ids, from the local cache only

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root, repo_id: str, files) -> None:
    """A Hub cache as huggingface_hub lays it out: blobs, a snapshot of symlinks, refs/main."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in files:
        blob = repo / "blobs" / f"blob-{file.name}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, hf_checkpoints, gguf_files):
    cache = tmp_path / "hub"
    fake_hub_cache(cache, "acme/tiny-llama", sorted(hf_checkpoints["llama_gqa"].iterdir()))
    fake_hub_cache(cache, "acme/tiny-qwen3-GGUF", [gguf_files["qwen3_tied", "Q8_0"][0]])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_id_from_the_local_cache(hub_cache, hf_checkpoints):
    for spec in ("acme/tiny-llama", f"acme/tiny-llama@{COMMIT}", "acme/tiny-llama@main"):
        source = resolve_model_source(spec)
        assert source.kind == "directory" and source.hub_id == "acme/tiny-llama"
        assert source.path == hub_cache / "models--acme--tiny-llama" / "snapshots" / COMMIT
    engine = LocalEngine("acme/tiny-llama", draft="acme/tiny-llama", num_speculative_tokens=3, adaptive=False)
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outputs] == [hf_greedy(hf_checkpoints["llama_gqa"], p, NEW_TOKENS) for p in PROMPTS]


def test_hub_repository_of_one_gguf_file(hub_cache, gguf_files):
    source = resolve_model_source("acme/tiny-qwen3-GGUF")
    assert source.kind == "gguf" and source.path.name == "model.gguf"
    reference = gguf_files["qwen3_tied", "Q8_0"][1]
    engine = LocalEngine("acme/tiny-qwen3-GGUF", draft="ngram", num_speculative_tokens=2, adaptive=False,
                         target_weights="fp")
    [out] = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert out.token_ids == hf_greedy(reference, PROMPTS[0], NEW_TOKENS)


def test_hub_id_not_in_the_cache_says_how_to_get_it(hub_cache):
    with pytest.raises(ModelSourceError) as info:
        resolve_model_source("acme/missing-model")
    message = str(info.value)
    assert "not in the local Hugging Face cache" in message and str(hub_cache) in message
    assert "hf download acme/missing-model" in message and "huggingface-cli download acme/missing-model" in message
    assert "HF_HUB_CACHE" in message and ".gguf" in message
    with pytest.raises(ModelSourceError, match="not in the local Hugging Face cache"):
        resolve_model_source("acme/tiny-llama@v9.9")  # a revision that was never downloaded


def test_hf_home_locates_the_cache(tmp_path, monkeypatch, hf_checkpoints):
    fake_hub_cache(tmp_path / "home" / "hub", "acme/tiny-llama", sorted(hf_checkpoints["llama_gqa"].iterdir()))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    snapshot = tmp_path / "home" / "hub" / "models--acme--tiny-llama" / "snapshots" / COMMIT
    assert resolve_model_source("acme/tiny-llama").path == snapshot


# ---------------------------------------------------------------- specs that name nothing

def test_bad_specs_are_clear_errors(tmp_path):
    with pytest.raises(ModelSourceError, match=r"GGUF file .*missing\.gguf does not exist"):
        resolve_model_source(str(tmp_path / "missing.gguf"))
    accepted = r"a Hugging Face checkpoint directory .*a \.gguf file, or a Hugging Face Hub id"
    with pytest.raises(ModelSourceError, match=rf"names nothing that exists, and is not one of the accepted forms: "
                                               rf"{accepted}"):
        resolve_model_source("just-a-name")
    with pytest.raises(ModelSourceError, match=accepted):
        resolve_model_source(str(tmp_path / "no" / "such" / "dir"))
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ModelSourceError, match=rf"is a file, not one of the accepted forms: {accepted}"):
        resolve_model_source(str(tmp_path / "weights.bin"))
    (tmp_path / "garbage.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelSourceError, match="cannot read .*garbage.gguf as GGUF"):
        load_model(tmp_path / "garbage.gguf")
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "config.json").write_text("{}")
    with pytest.raises(ModelSourceError, match=r"no \*\.safetensors weights"):
        resolve_model_source(str(tmp_path / "no-weights"))


# ---------------------------------------------------------------- the app layer goes through the resolver

def _serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for title, names in SERVE_SETTINGS.items():
        add_settings(parser.add_argument_group(title), names)
    return parser.parse_args(argv)


def test_serve_accepts_every_source_and_refuses_bad_ones(hub_cache, gguf_files, tmp_path, monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith("SPECDEC_")]:
        monkeypatch.delenv(name)
    path, _ = gguf_files["qwen2_biases", "Q4_0"]
    config = build_config(_serve_args(["--target", str(path), "--draft", "acme/tiny-llama", "--no-ray"]))
    assert config.target.model == str(path.resolve()) and config.draft.model == "acme/tiny-llama"
    with pytest.raises(ServeError, match="target model: .*not in the local Hugging Face cache"):
        build_config(_serve_args(["--target", "acme/nothing-here"]))
    with pytest.raises(ServeError, match=r"draft model: GGUF file .*missing\.gguf does not exist"):
        build_config(_serve_args(["--target", str(path), "--draft", str(tmp_path / "missing.gguf")]))
    (tmp_path / "bad").mkdir()
    shutil.copy(gguf_files["llama_gqa", "F32"][1] / "model.safetensors", tmp_path / "bad")
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 10}')
    with pytest.raises(ServeError, match="unsupported model family 'gpt2'"):
        build_config(_serve_args(["--target", str(tmp_path / "bad")]))


def test_bench_takes_gguf_files_and_hub_ids(hub_cache, gguf_files):
    path, reference = gguf_files["qwen2_biases", "Q8_0"]
    assert model_problem(str(path)) is None and model_problem("acme/tiny-llama") is None
    assert "not in the local Hugging Face cache" in model_problem("acme/absent")
    # Its Hugging Face baseline on a GGUF runs the same dequantized weights.
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(load_hf(str(path))(ids).logits, load_hf(str(reference))(ids).logits)
