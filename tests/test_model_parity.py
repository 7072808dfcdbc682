"""The runtime's logits equal Hugging Face's, for ragged batches over a paged cache."""
import pytest
import torch
from transformers import LlamaForCausalLM

from specdec.model import LlamaModel
from specdec.model.batch import prepare_forward


def hf_logits(model_dir, ids: torch.Tensor) -> torch.Tensor:
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(ids).logits


def test_ragged_prefill_decode_and_rollback(target_dir):
    ours = LlamaModel.load(target_dir)
    vocab = ours.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (3, 60), generator=gen)
    ref = hf_logits(target_dir, ids)
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


def test_only_requested_logits_are_computed(gqa_target_dir):
    ours = LlamaModel.load(gqa_target_dir)
    cache = ours.new_kv_cache(num_blocks=8, block_size=16)
    cache.add_sequence("s")
    out = ours.forward(prepare_forward(cache, ["s"], [[1, 2, 3, 4, 5]], [2]), cache)
    assert out.shape == (2, ours.config.vocab_size)
    assert out.dtype == torch.float32


def test_cpu_rejects_half_precision(gqa_target_dir):
    with pytest.raises(ValueError, match="float32"):
        LlamaModel.load(gqa_target_dir, dtype="bfloat16")


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LlamaModel.load(tmp_path)
