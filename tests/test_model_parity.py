"""The runtime's logits equal Hugging Face's, for ragged batches over a paged cache, for every
supported model family; unsupported models fail with errors that say why."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.model import ModelConfig, ModelSourceError, load_model
from specdec.model.batch import prepare_forward, sequence_kv_slots
from specdec.model.linear import onednn_available

from checkpoints import build_checkpoint

# The C kernels (specdec.model.cpu_kernels) where they build, and torch's ops, as on a GPU or a
# machine without a C compiler.
BOTH_PATHS = pytest.mark.parametrize("cpu_kernels", [True, False], ids=["c-kernels", "torch-ops"])


def hf_logits(model_dir, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(ids).logits


def check_ragged_prefill_decode_and_rollback(model_dir, cpu_kernels: bool = True):
    ours = load_model(model_dir, cpu_kernels=cpu_kernels)
    vocab = ours.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (3, 60), generator=gen)
    ref = hf_logits(model_dir, ids)
    cache = ours.new_kv_cache(num_blocks=40, block_size=8)
    seqs = ["a", "b", "c"]
    for s in seqs:
        cache.add_sequence(s)

    # Prefill three different lengths in one pass, logits at every position.
    lens = [5, 23, 41]
    out = ours.forward(prepare_forward(cache, seqs, [ids[i, :n].tolist() for i, n in enumerate(lens)], lens), cache)
    for row, chunk in enumerate(out.split(lens)):
        torch.testing.assert_close(chunk, ref[row, :lens[row]], atol=2e-4, rtol=1e-4)

    # A verify-shaped pass: K+1 = 4 new tokens for two sequences, 1 for the third.
    new = [ids[0, 5:9].tolist(), ids[1, 23:27].tolist(), ids[2, 41:42].tolist()]
    out = ours.forward(prepare_forward(cache, seqs, new, [4, 4, 1]), cache)
    torch.testing.assert_close(out[:4], ref[0, 5:9], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(out[4:8], ref[1, 23:27], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(out[8:], ref[2, 41:42], atol=2e-4, rtol=1e-4)

    # Roll back as after a rejection, then continue with the true tokens: stale K/V must not leak.
    cache.truncate_to("a", 6)
    out = ours.forward(prepare_forward(cache, ["a"], [ids[0, 6:30].tolist()], [24]), cache)
    torch.testing.assert_close(out, ref[0, 6:30], atol=2e-4, rtol=1e-4)
    cache.check_accounting()


@BOTH_PATHS
@pytest.mark.parametrize("packed, threads", [(False, 1), (True, 1), (True, 2)])
def test_every_product_path_matches_hugging_face(gqa_target_dir, family_dir, packed, threads, cpu_kernels):
    """Projections run through the C kernels' panels, or (torch's ops) MKL ([in, out]) or oneDNN
    (packed) depending on rows and threads (specdec.model.linear): prefill, single-row decode steps
    and a batch of decode steps all agree with Hugging Face on each path, biases (Qwen) included."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for model_dir in (gqa_target_dir, family_dir):
            ours = load_model(model_dir, packed_weights=packed, cpu_kernels=cpu_kernels)
            # With the C kernels every pass multiplies by their panels: no oneDNN copy is kept.
            expect_packed = packed and ours.kernels is None and onednn_available(torch.device("cpu"), torch.float32)
            for projection in (ours.weights.lm_head, ours.weights.layers[0].qkv):
                assert (projection.packed is not None) == expect_packed
                assert (projection.panels is not None) == (ours.kernels is not None)
            gen = torch.Generator().manual_seed(1)
            ids = torch.randint(0, ours.config.vocab_size, (2, 20), generator=gen)
            ref = hf_logits(model_dir, ids)
            cache = ours.new_kv_cache(num_blocks=16, block_size=8)
            for s in "ab":
                cache.add_sequence(s)
            out = ours.forward(prepare_forward(cache, ["a"], [ids[0, :12].tolist()], [12]), cache)
            torch.testing.assert_close(out, ref[0, :12], atol=2e-4, rtol=1e-4)
            for pos in range(12, 16):  # one row per pass
                out = ours.forward(prepare_forward(cache, ["a"], [[int(ids[0, pos])]], [1]), cache)
                torch.testing.assert_close(out[0], ref[0, pos], atol=2e-4, rtol=1e-4)
            ours.forward(prepare_forward(cache, ["b"], [ids[1, :15].tolist()], [1]), cache)
            out = ours.forward(prepare_forward(cache, ["a", "b"], [[int(ids[0, 16])], [int(ids[1, 15])]], [1, 1]),
                               cache)  # two rows
            torch.testing.assert_close(out, torch.stack([ref[0, 16], ref[1, 15]]), atol=2e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(before)


@BOTH_PATHS
def test_ragged_prefill_decode_and_rollback(target_dir, cpu_kernels):
    check_ragged_prefill_decode_and_rollback(target_dir, cpu_kernels)


@BOTH_PATHS
def test_ragged_parity_of_every_family(family_dir, cpu_kernels):
    check_ragged_prefill_decode_and_rollback(family_dir, cpu_kernels)


def test_family_switches_follow_the_checkpoint(family_dir):
    """What sets the families apart is read from config.json, and the parameter count is the
    checkpoint's (the stacked per-head q/k norm weights count once)."""
    raw = json.loads((family_dir / "config.json").read_text())
    model = load_model(family_dir)
    c = model.config
    assert c.family == raw["model_type"]
    assert c.qkv_bias == (raw["model_type"] == "qwen2" or raw.get("attention_bias", False))
    assert c.o_bias == (raw["model_type"] == "qwen3" and raw.get("attention_bias", False))
    assert c.qk_norm == (raw["model_type"] == "qwen3")
    assert c.head_dim == raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
    hf = AutoModelForCausalLM.from_pretrained(family_dir)
    assert model.num_parameters == hf.num_parameters()


def test_only_requested_logits_are_computed(gqa_target_dir):
    ours = load_model(gqa_target_dir)
    cache = ours.new_kv_cache(num_blocks=8, block_size=16)
    cache.add_sequence("s")
    out = ours.forward(prepare_forward(cache, ["s"], [[1, 2, 3, 4, 5]], [2]), cache)
    assert out.shape == (2, ours.config.vocab_size)
    assert out.dtype == torch.float32


def test_cpu_rejects_half_precision(gqa_target_dir):
    with pytest.raises(ValueError, match="float32"):
        load_model(gqa_target_dir, dtype="bfloat16")


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ModelSourceError, match="no config.json"):
        load_model(tmp_path)


def test_unsupported_family_is_named_with_the_supported_ones(gqa_target_dir, tmp_path):
    raw = json.loads((gqa_target_dir / "config.json").read_text())
    for model_type, arch in (("gpt2", "GPT2LMHeadModel"), ("qwen2_moe", "Qwen2MoeForCausalLM")):
        with pytest.raises(ValueError, match=rf"unsupported model family '{model_type}': specdec runs "
                                             r"llama, mistral, qwen2, qwen3"):
            ModelConfig.from_dict({**raw, "model_type": model_type, "architectures": [arch]})
    # Without a model_type the architectures decide.
    assert ModelConfig.from_dict({**{k: v for k, v in raw.items() if k != "model_type"},
                                  "architectures": ["Qwen2ForCausalLM"]}).family == "qwen2"
    # Through the loader, from a checkpoint on disk.
    phi3 = {**raw, "model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(phi3))
    (tmp_path / "model.safetensors").write_bytes((gqa_target_dir / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="unsupported model family 'phi3'"):
        load_model(tmp_path)


def test_sliding_window_smaller_than_the_context_is_refused(tmp_path):
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1)
    small = build_checkpoint(tmp_path / "small", family="mistral", sliding_window=100, max_position_embeddings=256,
                             **shape)
    refused = r"^sliding-window attention \(window 100 < context 256\) is not supported yet$"
    with pytest.raises(ValueError, match=refused):
        load_model(small)
    # A window covering the whole context changes nothing: it loads.
    wide = build_checkpoint(tmp_path / "wide", family="mistral", sliding_window=256, max_position_embeddings=256,
                            **shape)
    assert load_model(wide).config.family == "mistral"
    # Qwen2 slides only when use_sliding_window says so.
    qwen = build_checkpoint(tmp_path / "qwen", family="qwen2", max_position_embeddings=256, **shape)
    raw = json.loads((qwen / "config.json").read_text())
    # As Qwen2.5's own config.json has it: a window, switched off.
    assert ModelConfig.from_dict({**raw, "sliding_window": 100, "use_sliding_window": False}).family == "qwen2"
    sliding = build_checkpoint(tmp_path / "qwen-sliding", family="qwen2", sliding_window=100, use_sliding_window=True,
                               max_window_layers=0, max_position_embeddings=256, **shape)
    with pytest.raises(ValueError, match=r"window 100 < context 256"):
        load_model(sliding)


def test_lone_sequence_in_consecutive_blocks_is_read_without_a_gather(gqa_target_dir):
    """One sequence whose blocks are consecutive: attention views its keys in place (kv_start)
    and gets exactly the logits the gather gives; freed blocks come back in ascending order, so a
    later lone sequence is consecutive again."""
    import dataclasses

    ours = load_model(gqa_target_dir)
    cache = ours.new_kv_cache(num_blocks=16, block_size=4)
    cache.add_sequence("x")
    cache.append_slots("x", 9)  # blocks 0-2, then freed: the next sequence reuses them
    cache.free_sequence("x")
    cache.add_sequence("a")
    prompt = list(range(3, 17))
    ours.forward(prepare_forward(cache, ["a"], [prompt], [1]), cache)
    assert cache.block_table("a") == [0, 1, 2, 3]
    batch = prepare_forward(cache, ["a"], [[5]], [1])
    assert batch.kv_start == 0
    # Its key slots are one range, the same as the block tables give.
    assert torch.equal(batch.kv_slots, sequence_kv_slots(batch.block_tables, 4, batch.context_len))
    viewed = ours.forward(batch, cache)
    gathered = ours.forward(dataclasses.replace(batch, kv_start=None), cache)  # same slot, rewritten
    assert torch.equal(viewed, gathered)
    torch.testing.assert_close(viewed[0], hf_logits(gqa_target_dir, torch.tensor([prompt + [5]]))[0, -1],
                               atol=2e-4, rtol=1e-4)


def test_one_row_goes_through_onednn_only_for_matrices_large_enough(monkeypatch):
    """oneDNN's ~23 us a call loses to MKL's product for one row of a small matrix
    (specdec.model.linear); several rows, or a large matrix on several threads, take oneDNN."""
    from specdec.model.linear import ONEDNN_SINGLE_ROW_MIN_BYTES, Projection

    small = Projection(torch.randn(64, 128), packed=True)
    large = Projection(torch.randn(1024, ONEDNN_SINGLE_ROW_MIN_BYTES // 4096 + 1), packed=True)
    if small.packed is None:
        pytest.skip("this torch cannot pack weights for oneDNN")
    assert not small.single_row_packed and large.single_row_packed
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: calls.append(1) or real(*args))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for projection, rows, onednn in ((small, 1, False), (small, 6, True), (large, 1, True), (large, 6, True)):
            x = torch.randn(rows, projection.in_features)
            calls.clear()
            torch.testing.assert_close(projection(x), x @ projection.weight, atol=1e-4, rtol=1e-4)
            assert bool(calls) == onednn, (projection.weight.shape, rows)
    finally:
        torch.set_num_threads(before)
