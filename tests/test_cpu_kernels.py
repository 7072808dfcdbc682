"""specdec's C kernels (specdec.model.cpu_kernels): each one agrees with the torch ops it replaces,
the product and attention give every row the same bits whatever else the call holds and on any
number of threads, bad arguments are refused before C sees them, a whole pass through them agrees
with the torch pass and with Hugging Face for every family, and a machine without a compiler runs
torch's ops after one warning."""
import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from test_model_parity import check_ragged_prefill_decode_and_rollback, hf_logits

import specdec.model.kernel_forward as kernel_forward
from specdec.config import ConfigError, WorkerConfig
from specdec.model import cpu_kernels as kernels_module
from specdec.model import load_model
from specdec.model.batch import prepare_forward
from specdec.model.cpu_kernels import KernelArgumentError
from specdec.model.decoder import head_norm, rms_norm
from specdec.model.rope import RotaryTable

from checkpoints import build_checkpoint

kernels = kernels_module.load_cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler on this machine")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)  # (the kernels run on torch's OpenMP threads)
    yield request.param
    torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("rows, dim", [(1, 576), (5, 64), (3, 37)])
def test_add_rms_norm_matches_torch_with_and_without_a_residual(rows, dim):
    gen = torch.Generator().manual_seed(rows)
    x, delta = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen)
    weight = torch.rand(dim, generator=gen)
    out = torch.empty_like(x)
    first = x.clone()
    kernels.add_rms_norm(first, None, weight, out, 1e-5)
    torch.testing.assert_close(out, rms_norm(x, weight, 1e-5), atol=1e-6, rtol=1e-5)
    kernels.add_rms_norm(first, delta, weight, out, 1e-5)
    torch.testing.assert_close(first, x + delta)  # the residual stream is updated in place
    torch.testing.assert_close(out, rms_norm(x + delta, weight, 1e-5), atol=1e-6, rtol=1e-5)


@needs_kernels
def test_silu_mul_matches_torch():
    gate_up = torch.randn(3, 2 * 100, generator=torch.Generator().manual_seed(0)) * 6
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 30.0, -30.0, 90.0, -90.0, 1e4, -1e4])  # e^-|x| under/overflow
    out = torch.empty(3, 100)
    kernels.silu_mul(gate_up, out)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-6, rtol=1e-5)


@needs_kernels
def test_argmax_gives_torchs_index_for_ties_infinities_and_nans(threads):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 49152, generator=gen)
    x[1, 7] = x[1, 4000] = x[1, 49151] = 50.0  # a tie: the first
    x[2] = float("-inf")  # every value -inf: index 0
    x[3, 100] = float("inf")
    x[4, 30000], x[4, 5] = float("nan"), 99.0  # a NaN after the largest number: the NaN
    x[5, 10], x[5, 20] = float("nan"), float("nan")
    x[6, 0] = 1e30  # at the first index
    x[7] = 0.0
    x[7, 12] = -0.0  # equal to 0.0: still the first
    assert torch.equal(kernels.argmax(x), x.argmax(dim=-1))
    padded = x.view(3, 3, 49152)[:, :2]  # not contiguous; [3, 2] indices
    assert torch.equal(kernels_module.row_argmax(padded, kernels), padded.argmax(dim=-1))
    assert torch.equal(kernels_module.row_argmax(x.double(), kernels), x.argmax(dim=-1))  # torch's, for doubles
    with pytest.raises(KernelArgumentError, match="argmax"):
        kernels.argmax(torch.empty(2, 0))


def sample_top_row(x: torch.Tensor, temperature: float, u: float, width: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """kernels.sample_top on the one row x [V]: (the drawn entry, ids [width], q [width])."""
    ids, q = torch.zeros(1, width, dtype=torch.int64), torch.zeros(1, width)
    at, = kernels.sample_top(x[None], [0], [width], [temperature], [u], ids, q)
    return at, ids[0], q[0]


def softmax_draw(q: torch.Tensor, u: float) -> int:
    """The inverse-CDF draw sample_from_probs makes (float64 running sums): the first index whose
    running sum exceeds u x the total."""
    cdf = torch.cumsum(q.double(), 0)
    return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))


@needs_kernels
@pytest.mark.parametrize("vocab, width, temperature", [(4096, 256, 0.8), (50, 5, 1.0), (128256, 256, 0.3),
                                                         (300, 300, 2.0), (33, 1, 0.8)])
def test_sample_top_keeps_the_largest_logits_in_order_and_draws_from_their_softmax(vocab, width, temperature):
    gen = torch.Generator().manual_seed(vocab + width)
    for trial in range(20):
        x = torch.randn(vocab, generator=gen) * (1 + trial % 4)
        u = float(torch.rand(1, generator=gen, dtype=torch.float64))
        at, ids, q = sample_top_row(x, temperature, u, width)
        top = torch.topk(x, width)
        assert torch.equal(x[ids], top.values)  # the same logits, largest first
        torch.testing.assert_close(q, torch.softmax(top.values / temperature, 0), atol=1e-6, rtol=1e-5)
        assert at == softmax_draw(q, u) and q[at] > 0


@needs_kernels
def test_sample_top_orders_ties_by_index_and_survives_extreme_logits():
    x = torch.zeros(40)
    x[[30, 3, 17]] = 5.0
    x[8] = -0.0  # equal to the zeros: by index too
    assert sample_top_row(x, 1.0, 0.5, 6)[1].tolist() == [3, 17, 30, 0, 1, 2]
    x = torch.full((100,), float("-inf"))
    x[7], x[9], x[11] = float("inf"), 3e38, -3e38
    for temperature in (1e-30, 1.0, 1e30):  # below the least temperature; a vast one
        at, ids, q = sample_top_row(x, temperature, 1.0 - 2.0**-53, 6)  # u next to 1: the last positive
        assert torch.isfinite(q).all() and abs(float(q.sum()) - 1) < 1e-6 and q[at] > 0 and int(ids[0]) == 7


@needs_kernels
def test_sample_top_refuses_a_nan_row_and_wrong_shapes():
    x = torch.randn(2, 64)
    x[1, 40] = float("nan")
    ids, q = torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, 8)
    drawn = kernels.sample_top(x, [0, 1], [8, 8], [1.0, 1.0], [0.5, 0.5], ids, q)
    assert drawn[0] >= 0 and drawn[1] == -1  # the caller takes torch's ops
    for rows, widths in (([2], [8]), ([0], [65]), ([0], [9]), ([0], [0])):  # no row 2; too wide
        with pytest.raises(KernelArgumentError, match="sample_top"):
            kernels.sample_top(x, rows, widths, [1.0], [0.5], ids[:1], q[:1])
    with pytest.raises(KernelArgumentError, match="sample_top"):
        kernels.sample_top(x, [0], [8], [1.0], [0.5], ids[:1], q[:1, :7])


@needs_kernels
@pytest.mark.parametrize("with_head_norm", [False, True])
def test_rope_store_kv_rotates_q_and_k_and_writes_the_cache(with_head_norm):
    heads, kv_heads, dim, tokens = 6, 2, 24, 3
    gen = torch.Generator().manual_seed(1)
    rotary = RotaryTable(dim, 64, 10000.0, None, torch.device("cpu"), torch.float32)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    positions, slots = torch.tensor([0, 17, 63]), torch.tensor([9, 2, 30])
    norm = torch.rand(heads + kv_heads, dim, generator=gen) if with_head_norm else None
    k_cache, v_cache = torch.zeros(4, 8, kv_heads, dim), torch.zeros(4, 8, kv_heads, dim)  # 4 blocks of 8
    expected = qkv.clone()
    kernels.rope_store_kv(qkv, heads, kv_heads, positions, rotary.cos, rotary.sin, norm, 1e-6, slots, k_cache,
                          v_cache)
    qk = expected[:, :(heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    if norm is not None:
        qk = head_norm(qk, norm, 1e-6)
    qk = RotaryTable.apply(qk, *rotary.lookup(positions))
    torch.testing.assert_close(qkv[:, :(heads + kv_heads) * dim], qk.reshape(tokens, -1), atol=1e-5, rtol=1e-5)
    k_rows, v_rows = k_cache.view(32, kv_heads, dim), v_cache.view(32, kv_heads, dim)
    torch.testing.assert_close(k_rows[slots], qk[:, heads:])
    torch.testing.assert_close(v_rows[slots], expected[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim))
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert k_rows[untouched].abs().sum() == 0 and v_rows[untouched].abs().sum() == 0


@needs_kernels
@pytest.mark.parametrize("k, n, bias", [(64, 300, True), (37, 64, False), (384, 640, False), (5, 1, True)])
def test_matmul_matches_a_float64_product(k, n, bias):
    gen = torch.Generator().manual_seed(k)
    weight, x = torch.randn(k, n, generator=gen), torch.randn(7, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    out = kernels.matmul(x, kernels.pack(weight, b), torch.empty(7, n))
    expected = x.double() @ weight.double() + (0 if b is None else b.double())
    torch.testing.assert_close(out.double(), expected, atol=1e-4 * k ** 0.5, rtol=1e-5)


@needs_kernels
def test_matmul_gives_a_row_the_same_bits_alone_among_any_rows_and_on_any_threads(threads):
    """What makes a request's logits independent of its batch: the row computed alone (a decode
    step) is bit for bit the row computed at any place among 2 to 70 rows (verify passes, batches,
    prompts), on 1 or 2 threads. MKL's one-row product differs from its many-row one here."""
    gen = torch.Generator().manual_seed(3)
    weight = kernels.pack(torch.randn(384, 640, generator=gen), torch.randn(640, generator=gen))
    row = torch.randn(1, 384, generator=gen)
    alone = kernels.matmul(row, weight, torch.empty(1, 640))
    for rows in (2, 3, 4, 5, 6, 7, 8, 11, 13, 48, 70):  # (every block shape: 6 or 4 rows a pass)
        for place in {0, rows // 2, rows - 1}:
            x = torch.randn(rows, 384, generator=gen)
            x[place] = row[0]
            assert torch.equal(kernels.matmul(x, weight, torch.empty(rows, 640))[place], alone[0]), (rows, place)


@needs_kernels
def test_arguments_c_would_misread_are_refused_before_the_call():
    weight = kernels.pack(torch.randn(8, 16))
    with pytest.raises(KernelArgumentError, match="matmul"):
        kernels.matmul(torch.randn(2, 9), weight, torch.empty(2, 16))  # inner sizes differ
    with pytest.raises(KernelArgumentError, match="matmul"):
        kernels.matmul(torch.randn(2, 8), weight, torch.empty(3, 16))  # out too small
    with pytest.raises(KernelArgumentError, match="contiguous CPU torch.float32"):
        kernels.matmul(torch.randn(8, 2).t(), weight, torch.empty(2, 16))  # not contiguous
    with pytest.raises(KernelArgumentError, match="torch.float32"):
        kernels.matmul(torch.randn(2, 8, dtype=torch.float64), weight, torch.empty(2, 16))
    with pytest.raises(KernelArgumentError, match="add_rms_norm"):
        kernels.add_rms_norm(torch.randn(2, 8), None, torch.ones(7), torch.empty(2, 8), 1e-5)
    with pytest.raises(KernelArgumentError, match="silu_mul"):
        kernels.silu_mul(torch.randn(2, 10), torch.empty(2, 4))
    rotary = RotaryTable(8, 16, 10000.0, None, torch.device("cpu"), torch.float32)
    cache, one = torch.zeros(1, 4, 1, 8), torch.tensor([0])
    with pytest.raises(KernelArgumentError, match="torch.int64"):
        kernels.rope_store_kv(torch.randn(1, 32), 2, 1, torch.tensor([0], dtype=torch.int32), rotary.cos, rotary.sin,
                              None, 1e-6, one, cache, cache)
    # Each check's message is made only when it fails (the checks run on every pass): each is made here.
    with pytest.raises(KernelArgumentError, match=r"rope_store_kv: qkv \(1, 31\)"):
        kernels.rope_store_kv(torch.randn(1, 31), 2, 1, one, rotary.cos, rotary.sin, None, 1e-6, one, cache, cache)
    with pytest.raises(KernelArgumentError, match=r"KV cache of torch.float64"):
        kernels.rope_store_kv(torch.randn(1, 32), 2, 1, one, rotary.cos, rotary.sin, None, 1e-6, one,
                              cache.double(), cache.double())
    with pytest.raises(KernelArgumentError, match=r"attend: qkv \(1, 32\), out \(1, 15\)"):
        kernels.attend(torch.randn(1, 32), 2, 1, one, one, torch.zeros(1, 4, dtype=torch.int64), cache, cache, 1.0,
                       torch.empty(1, 15))
    table = (kernels_module._DecoderLayer * 1)()  # a layer of 2 + 2 * 1 heads of 8 -> 32, widths 8 <-> 8
    table[0].qkv.n, table[0].o_proj.n, table[0].gate_up.n, table[0].down.n = 32, 8, 8, 8
    with pytest.raises(KernelArgumentError, match=r"decoder_layers: x \(1, 8\)"):  # its MLP is 4 wide, not 5
        kernels.decoder_layers(table, torch.ones(8), torch.randn(1, 8), 2, 1, 5, 1e-5, 1.0, one, rotary.cos,
                               rotary.sin, one, one, torch.zeros(1, 4, dtype=torch.int64), cache[None], cache[None])
    with pytest.raises(KernelArgumentError, match=r"decoder_layers: x \(1, 8\).*positions \(2,\)"):
        kernels.decoder_layers([], torch.ones(8), torch.randn(1, 8), 2, 1, 4, 1e-5, 1.0, torch.tensor([0, 1]),
                               rotary.cos, rotary.sin, one, one, torch.zeros(1, 4, dtype=torch.int64),
                               cache[None], cache[None])


@needs_kernels
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 4, 128), (7, 1, 24), (4, 2, 72)])
def test_attend_matches_causal_sdpa_over_scattered_slots(heads, kv_heads, dim):
    """Two sequences in scattered cache rows, one with three new tokens (causal among them), one with
    one; head sizes on the vector path (64, 128), off it (24) and both (72); every group size."""
    gen = torch.Generator().manual_seed(dim)
    new = [3, 1]  # new tokens of the two sequences (context 40 and 13)
    rows = torch.randperm(80, generator=gen)
    kv_slots = torch.stack([rows[:40], torch.cat([rows[40:53], rows[:27]])])  # [B, 40], tail padding
    k_cache, v_cache = torch.randn(80, kv_heads, dim, generator=gen), torch.randn(80, kv_heads, dim, generator=gen)
    qkv = torch.randn(sum(new), (heads + 2 * kv_heads) * dim, generator=gen)
    token_seqs, positions = torch.tensor([0, 0, 0, 1]), torch.tensor([37, 38, 39, 12])
    out = torch.empty(sum(new), heads * dim)
    kernels.attend(qkv, heads, kv_heads, token_seqs, positions, kv_slots, k_cache, v_cache, dim ** -0.5, out)
    for t in range(sum(new)):
        seq, length = int(token_seqs[t]), int(positions[t]) + 1
        keys, values = k_cache[kv_slots[seq, :length]], v_cache[kv_slots[seq, :length]]  # [L, Hkv, D]
        q = qkv[t, :heads * dim].view(heads, 1, dim)
        expected = F.scaled_dot_product_attention(q, keys.transpose(0, 1), values.transpose(0, 1), enable_gqa=True)
        torch.testing.assert_close(out[t], expected.reshape(-1), atol=1e-5, rtol=1e-4)


@needs_kernels
def test_attend_gives_a_token_the_same_bits_alone_among_any_tokens_and_on_any_threads(threads):
    heads, kv_heads, dim, length = 6, 2, 64, 300
    gen = torch.Generator().manual_seed(9)
    k_cache, v_cache = torch.randn(400, kv_heads, dim, generator=gen), torch.randn(400, kv_heads, dim, generator=gen)
    kv_slots = torch.randperm(400, generator=gen)[:length].view(1, length)
    qkv = torch.randn(length, (heads + 2 * kv_heads) * dim, generator=gen)
    positions, seqs = torch.arange(length), torch.zeros(length, dtype=torch.long)
    every = torch.empty(length, heads * dim)  # a 300-token prompt: shared out among threads
    kernels.attend(qkv, heads, kv_heads, seqs, positions, kv_slots, k_cache, v_cache, 0.125, every)
    for t in (0, 150, 299):  # one token at a time, as decode steps see them
        one = torch.empty(1, heads * dim)
        kernels.attend(qkv[t:t + 1].contiguous(), heads, kv_heads, seqs[:1], positions[t:t + 1], kv_slots, k_cache,
                       v_cache, 0.125, one)
        assert torch.equal(one[0], every[t]), t


@needs_kernels
def test_kernel_pass_agrees_with_hugging_face_for_every_family(family_dir):
    """Ragged prefill, verify-shaped passes, decode and rollback, each family's quirks (biases,
    per-head norms, head_dim != hidden / heads)."""
    check_ragged_prefill_decode_and_rollback(family_dir)


@needs_kernels
def test_kernel_pass_equals_the_torch_pass_on_a_64_wide_head_model(tmp_path):
    """head_dim 64 takes the vector paths of attention; logits of decode and verify passes over
    non-consecutive blocks agree with the torch pass and Hugging Face."""
    model_dir = build_checkpoint(tmp_path / "wide", vocab_size=300, hidden_size=192, intermediate_size=256,
                                 num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1)
    fused, plain = load_model(model_dir), load_model(model_dir, cpu_kernels=False)
    assert fused.kernels is not None and plain.kernels is None
    prompts = [list(range(5, 45)), list(range(50, 71))]
    caches = [model.new_kv_cache(num_blocks=32, block_size=4) for model in (fused, plain)]
    for model, cache in zip((fused, plain), caches):
        for i in range(len(prompts)):
            cache.add_sequence(str(i))
        for start in range(0, 40, 4):  # 4 tokens a pass: the two sequences' blocks alternate
            ids = [str(i) for i, p in enumerate(prompts) if start < len(p)]
            model.forward(prepare_forward(cache, ids, [prompts[int(i)][start:start + 4] for i in ids],
                                          [1] * len(ids)), cache)
    table = caches[0].block_table("0")
    assert table != list(range(table[0], table[0] + len(table)))
    verify = [[7, 8, 9, 10, 11, 12], [3]]
    logits = [m.forward(prepare_forward(c, ["0", "1"], verify, [6, 1]), c) for m, c in zip((fused, plain), caches)]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
    reference = hf_logits(model_dir, torch.tensor([prompts[0] + verify[0]]))[0, -6:]
    torch.testing.assert_close(logits[0][:6], reference, atol=2e-4, rtol=1e-4)


def test_positions_past_the_rotary_table_take_the_torch_path(gqa_target_dir):
    """(Which raises the clear error; the C kernels would read past the table.)"""
    model = load_model(gqa_target_dir)
    cache = model.new_kv_cache(num_blocks=40, block_size=8)
    cache.add_sequence("a")
    prompt = prepare_forward(cache, ["a"], [list(range(100))], [1])
    assert kernel_forward.kernel_forward_fits(prompt, model.rotary.cos.shape[0])
    past_the_table = dataclasses.replace(prompt, context_len=model.rotary.cos.shape[0] + 1)
    assert not kernel_forward.kernel_forward_fits(past_the_table, model.rotary.cos.shape[0])


def test_the_setting_turns_the_kernels_off_and_is_checked(gqa_target_dir):
    assert load_model(gqa_target_dir, cpu_kernels=False).kernels is None
    assert WorkerConfig().cpu_kernels is True
    with pytest.raises(ConfigError, match="worker.cpu_kernels must be true or false"):
        WorkerConfig(cpu_kernels="yes")


@pytest.fixture
def fresh_kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    kernels_module.load_cpu_kernels.cache_clear()
    yield tmp_path / "kernels"
    kernels_module.load_cpu_kernels.cache_clear()


def test_without_a_compiler_models_run_torch_ops_after_one_warning(fresh_kernel_cache, monkeypatch, caplog,
                                                                    gqa_target_dir):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger=kernels_module.__name__):
        assert kernels_module.load_cpu_kernels() is None
        model = load_model(gqa_target_dir)
    assert model.kernels is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "running torch's ops instead" in warnings[0]
    cache = model.new_kv_cache(num_blocks=8, block_size=8)
    cache.add_sequence("a")
    assert model.forward(prepare_forward(cache, ["a"], [[1, 2, 3]], [1]), cache).shape == (1, 300)


@needs_kernels
def test_the_library_is_built_once_then_loaded_from_the_cache(fresh_kernel_cache, monkeypatch):
    built = kernels_module._build("cc")
    assert built.parent == fresh_kernel_cache and built.exists()
    assert list(fresh_kernel_cache.iterdir()) == [built]  # no temporary files left behind

    def no_compiling(args, **kwargs):
        assert args[-1] == "--version", f"compiled again: {args}"
        return real_run(args, **kwargs)

    real_run = kernels_module.subprocess.run
    monkeypatch.setattr(kernels_module.subprocess, "run", no_compiling)
    assert kernels_module._build("cc") == built
    assert kernels_module.load_cpu_kernels() is not None


def test_a_failing_build_is_reported_with_the_compiler_output(fresh_kernel_cache, monkeypatch, tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(kernels_module, "SOURCE", broken)
    with pytest.raises(RuntimeError, match="failed: .*error"):
        kernels_module._build("cc")
    assert not any(fresh_kernel_cache.glob("*.so"))
