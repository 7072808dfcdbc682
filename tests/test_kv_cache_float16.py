"""A float16 KV cache (kv_cache_dtype float16) on the CPU: keys and values are rounded to the
nearest float16 exactly as torch rounds them, attention over them is attention over those values
(the same bits as over a float32 cache holding them), on the vector path and the portable one;
plain and speculative decoding then give the same greedy tokens and the target's distribution;
the cache takes half the memory; other dtypes and GPUs are refused with the setting's name."""
import math
import shutil

import pytest
import torch
from test_sampling_distribution import NEW, PARAMS, PROMPT, SAMPLES, SHAPE, chi_square_pvalue, exact_distribution

from specdec import LocalEngine, SamplingParams
from specdec.config import ConfigError, WorkerConfig
from specdec.model import cpu_kernels as kernels_module
from specdec.model import load_model
from specdec.model.batch import prepare_forward
from specdec.model.decoder import kv_cache_dtype_for
from specdec.model.memory_budget import bytes_per_block
from specdec.model.rope import RotaryTable

from checkpoints import build_checkpoint, perturbed_copy

native = kernels_module.load_cpu_kernels()
needs_kernels = pytest.mark.skipif(native is None, reason="no C compiler on this machine")


@pytest.fixture(scope="module", params=["native", "portable"])
def kernels(request):
    """This CPU's build, and one without AVX2, FMA and F16C: plain C loops and conversions."""
    if request.param == "native":
        return native
    flags = ("-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx512f")
    return kernels_module.open_kernels(kernels_module._build(shutil.which("cc") or "cc", flags))


# Values whose rounding is easy to get wrong: ties to even, the largest float16 and the first
# value that rounds past it, subnormals and their halfway points, the smallest that does not
# vanish, signed zeros, infinities and NaN.
EDGES = [0.0, -0.0, 1.0, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 1.0 + 2 ** -11 + 2 ** -30, 65504.0, 65519.99,
         65520.0, -65520.0, 1e6, 2 ** -14, 2 ** -14 - 2 ** -25, 2 ** -24, 2 ** -25, 2 ** -25 + 2 ** -40,
         3 * 2 ** -25, 2 ** -26, 1e-40, -1e-7, 6.1e-5, math.inf, -math.inf, math.nan, 0.1, -3.14159]


@needs_kernels
def test_the_cache_rounds_keys_and_values_to_the_nearest_float16_as_torch_does(kernels):
    heads, kv_heads, dim = 2, 1, 32
    gen = torch.Generator().manual_seed(4)
    values = torch.cat([torch.tensor(EDGES), torch.randn(64 - len(EDGES), generator=gen) * 100]).view(2, dim)
    qkv = torch.randn(2, (heads + 2 * kv_heads) * dim, generator=gen)
    qkv[:, (heads + kv_heads) * dim:] = values  # the v heads are stored as they are (k is rotated first)
    k_cache, v_cache = torch.zeros(2, 4, kv_heads, dim, dtype=torch.float16), torch.zeros(2, 4, kv_heads, dim,
                                                                                          dtype=torch.float16)
    rotary = RotaryTable(dim, 16, 10000.0, None, torch.device("cpu"), torch.float32)
    slots = torch.tensor([5, 2])
    kernels.rope_store_kv(qkv, heads, kv_heads, torch.tensor([3, 9]), rotary.cos, rotary.sin, None, 1e-6, slots,
                          k_cache, v_cache)
    stored = v_cache.view(8, dim)[slots]
    expected = values.half()
    assert torch.equal(stored.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(stored.view(torch.int16)[finite], expected.view(torch.int16)[finite])
    rotated_k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(2, kv_heads, dim)
    assert torch.equal(k_cache.view(8, kv_heads, dim)[slots], rotated_k.half())


@needs_kernels
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 4, 128), (7, 1, 24), (4, 2, 72)])
def test_attention_over_a_float16_cache_is_attention_over_its_values(kernels, heads, kv_heads, dim):
    """The same bits as over a float32 cache holding the float16 values: only the storage differs.
    Head sizes on the vector path (64, 128), off it (24) and both (72); every group size."""
    gen = torch.Generator().manual_seed(dim)
    rows = torch.randperm(80, generator=gen)
    kv_slots = torch.stack([rows[:40], torch.cat([rows[40:53], rows[:27]])])
    k16 = torch.randn(80, kv_heads, dim, generator=gen).half()
    v16 = torch.randn(80, kv_heads, dim, generator=gen).half()
    qkv = torch.randn(4, (heads + 2 * kv_heads) * dim, generator=gen)
    token_seqs, positions = torch.tensor([0, 0, 0, 1]), torch.tensor([37, 38, 39, 12])
    over_half, over_float = torch.empty(4, heads * dim), torch.empty(4, heads * dim)
    kernels.attend(qkv, heads, kv_heads, token_seqs, positions, kv_slots, k16, v16, dim ** -0.5, over_half)
    kernels.attend(qkv, heads, kv_heads, token_seqs, positions, kv_slots, k16.float(), v16.float(), dim ** -0.5,
                   over_float)
    assert torch.equal(over_half, over_float)


@needs_kernels
def test_a_cache_of_mixed_or_other_dtypes_is_refused_before_the_call():
    qkv, out = torch.zeros(1, 4 * 8), torch.empty(1, 2 * 8)
    seqs, positions, kv_slots = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.zeros(
        1, 1, dtype=torch.long)
    for k, v in [(torch.zeros(4, 1, 8, dtype=torch.float16), torch.zeros(4, 1, 8)),
                 (torch.zeros(4, 1, 8, dtype=torch.bfloat16), torch.zeros(4, 1, 8, dtype=torch.bfloat16))]:
        with pytest.raises(kernels_module.KernelArgumentError, match="KV cache"):
            native.attend(qkv, 2, 1, seqs, positions, kv_slots, k, v, 1.0, out)


@pytest.fixture(scope="module")
def pair(gqa_target_dir, tmp_path_factory):
    draft = perturbed_copy(gqa_target_dir, tmp_path_factory.mktemp("f16-draft"), noise=0.3)
    return str(gqa_target_dir), str(draft)


PROMPTS = [[3, 17, 42, 7, 99, 12, 5], [8, 8, 8, 21, 30, 8, 8, 8, 21], [150], list(range(40, 72))]


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
def test_speculative_greedy_equals_plain_greedy_on_a_float16_cache(pair, adaptive):
    target, draft = pair
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = LocalEngine(target, kv_cache_dtype="float16", kv_block_size=8)
    assert plain.target_worker.cache.k.dtype == torch.float16
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    for drafter in (draft, "ngram", target):
        engine = LocalEngine(target, draft=drafter, kv_cache_dtype="float16", kv_block_size=8,
                             num_speculative_tokens=4, adaptive=adaptive)
        outputs = engine.generate(PROMPTS, params)
        assert [o.token_ids for o in outputs] == expected, drafter
        # Speculation happened: an adaptive policy's first rounds ask 1 token of each request
        # whatever the machine's speed; what it asks later follows timings, so a kept token is
        # certain only at fixed K or with the target as its own draft.
        assert any(o.stats.proposed_tokens for o in outputs), drafter
        if not adaptive or drafter == target:
            assert any(o.stats.acceptance_rate for o in outputs), drafter
        engine.target_worker.cache.check_accounting()


def test_sampled_tokens_follow_the_target_on_a_float16_cache(tmp_path):
    """The chi-square suite's target and prompt, drafted by a perturbed copy at fixed K, against
    the target's exact float32 distribution: the float16 cache moves it by ~1e-4, far below what
    3,000 samples resolve, while a wrong acceptance rule fails (test_sampling_distribution)."""
    target = build_checkpoint(tmp_path / "target", seed=3, initializer_range=0.08, **SHAPE)
    draft = perturbed_copy(target, tmp_path / "draft", noise=0.8)
    params = PARAMS["filters"]
    engine = LocalEngine(str(target), draft=str(draft), num_speculative_tokens=3, max_batch_size=1000,
                         adaptive=False, kv_cache_dtype="float16")
    sp = [SamplingParams(max_new_tokens=NEW, ignore_eos=True, seed=1000 + i, **params) for i in range(SAMPLES)]
    outputs = engine.generate([PROMPT] * SAMPLES, sp)
    assert chi_square_pvalue([tuple(o.token_ids) for o in outputs], exact_distribution(target, params)) > 1e-3
    assert 0.0 < sum(o.stats.acceptance_rate or 0 for o in outputs) / SAMPLES < 1.0  # accepts and resamples


def test_the_torch_path_keeps_a_float16_cache_too(pair):
    """Without the C kernels (no compiler) the same setting works through torch's ops: the cache
    holds the rounded values and the logits agree with the kernels' to float32 rounding."""
    target, _ = pair
    logits = {}
    for use_kernels in (False, True):
        model = load_model(target, cpu_kernels=use_kernels, kv_cache_dtype="float16")
        cache = model.new_kv_cache(8, 16)
        cache.add_sequence("s")
        logits[use_kernels] = model.forward(prepare_forward(cache, ["s"], [PROMPTS[3]], [4]), cache)
        assert cache.k.dtype == torch.float16 and cache.k.abs().sum() > 0
    torch.testing.assert_close(logits[False], logits[True], atol=2e-4, rtol=1e-4)


def test_the_cache_takes_half_the_memory(pair):
    target, _ = pair
    full, half = load_model(target), load_model(target, kv_cache_dtype="float16")
    assert bytes_per_block(half, 16) * 2 == bytes_per_block(full, 16)
    assert half.new_kv_cache(2, 16).k.nbytes * 2 == full.new_kv_cache(2, 16).k.nbytes


def test_other_cache_dtypes_and_gpus_are_refused_with_the_setting_named():
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        WorkerConfig(kv_cache_dtype="bfloat16")
    with pytest.raises(ValueError, match="kv_cache_dtype float16 on a bfloat16 model"):
        kv_cache_dtype_for("float16", torch.bfloat16, on_cpu=False)
    assert kv_cache_dtype_for("auto", torch.bfloat16, on_cpu=False) == torch.bfloat16
    assert kv_cache_dtype_for("float16", torch.float32, on_cpu=True) == torch.float16
