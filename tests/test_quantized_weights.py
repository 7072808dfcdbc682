"""Weights held as 8- or 4-bit codes (specdec.model.quantized, cpu_kernels.c's quantized products):
the product is the quantized input times the codes, a row gets the same bits alone or among any
rows and on any threads, the CPU's dot-product instructions and the portable C give the same
numbers, and speculative decoding at each format is exactly that format's plain decoding (greedy
token for token, sampled in distribution)."""
import itertools
import shutil

import pytest
import torch
from test_sampling_distribution import PROMPT, SHAPE, chi_square_pvalue, continuation_probs, hf_processors

from specdec import LocalEngine, SamplingParams
from specdec.config import ConfigError, WorkerConfig
from specdec.model import cpu_kernels as kernels_module
from specdec.model import load_model
from specdec.model.batch import prepare_forward
from specdec.model.cpu_kernels import KernelArgumentError
from specdec.model.quantized import GROUP, QuantizedMatrix, quantize, stack_rows

from checkpoints import build_checkpoint, perturbed_copy
from gguf_files import write_gguf

kernels = kernels_module.load_cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler on this machine")


def quantized_input(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernels see it: per group of GROUP, round(x / d) * d with d = max |x| / 127."""
    groups = x.view(x.shape[0], -1, GROUP)
    scale = groups.abs().amax(dim=2, keepdim=True) / 127
    return (torch.round(groups / scale) * scale).view_as(x)


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("k, n, bias", [(64, 300, True), (576, 960, False), (96, 17, True), (128, 148, False)])
def test_product_is_the_quantized_input_times_the_codes(bits, k, n, bias):
    gen = torch.Generator().manual_seed(k + n + bits)
    matrix = quantize(torch.randn(n, k, generator=gen) * 0.05, bits)
    b = torch.randn(n, generator=gen) if bias else None
    weight = kernels.pack_quantized(matrix, b)
    for m in (1, 3, 4, 9):
        x = torch.randn(m, k, generator=gen)
        expected = quantized_input(x).double() @ matrix.dequantize().double().t()
        if b is not None:
            expected += b.double()
        out = kernels.matmul(x, weight, torch.empty(m, n))
        torch.testing.assert_close(out.double(), expected, atol=1e-5 * k ** 0.5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4])
def test_a_row_gets_the_same_bits_alone_among_any_rows_and_on_any_threads(bits):
    gen = torch.Generator().manual_seed(bits)
    weight = kernels.pack_quantized(quantize(torch.randn(640, 384, generator=gen), bits), torch.randn(640))
    row = torch.randn(1, 384, generator=gen)
    alone = kernels.matmul(row, weight, torch.empty(1, 640))
    before = torch.get_num_threads()
    try:
        for threads, rows in itertools.product((1, 2), (2, 4, 5, 9, 70)):
            torch.set_num_threads(threads)
            for place in {0, rows // 2, rows - 1}:
                x = torch.randn(rows, 384, generator=gen)
                x[place] = row[0]
                assert torch.equal(kernels.matmul(x, weight, torch.empty(rows, 640))[place], alone[0])
    finally:
        torch.set_num_threads(before)


# Builds without the faster paths, each taking the next one down (quant_dot_simd: 2 AVX-512 VNNI,
# 1 AVX2, 0 plain C).
SLOWER_BUILDS = {1: ("-mno-avx512f",), 0: ("-mno-avx512f", "-mno-avx2", "-mno-fma")}


@needs_kernels
@pytest.mark.parametrize("path", sorted(SLOWER_BUILDS))
def test_every_path_of_the_sums_gives_the_same_bits(path, tmp_path, monkeypatch):
    """Integer sums are exact in any order: the library built without this CPU's dot-product
    instructions gives the same bits, so a model's tokens do not depend on which path a machine
    runs. Inputs and codes at their ends check that no partial sum overflows: 4-bit codes of 15
    times inputs of 127 fill a group's int16 sums to 30,480 on AVX2."""
    if kernels._lib.quant_dot_simd() <= path:
        pytest.skip("this CPU runs that path already")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    slower = kernels_module.open_kernels(kernels_module._build(shutil.which("cc") or "cc", SLOWER_BUILDS[path]))
    assert slower._lib.quant_dot_simd() == path
    gen = torch.Generator().manual_seed(5)
    for bits in (8, 4):
        ends = torch.where(torch.rand(200, 128, generator=gen) < 0.5, -1.0, 1.0)  # codes at both ends
        top = torch.ones(200, 128)
        top[:, ::GROUP] = -1.0  # all codes but one per group at the top (4-bit: 15; 8-bit: 127)
        for matrix in (quantize(torch.randn(200, 128, generator=gen), bits), quantize(ends, bits), quantize(top, bits)):
            for m in (1, 3, 6, 7, 9):  # odd counts: a last row without its pair
                x = torch.randn(m, 128, generator=gen)
                x[0], x[-1] = 1.0, torch.where(torch.arange(128) % 3 == 0, 1.0, -1.0)  # inputs at +-127
                ours = kernels.matmul(x, kernels.pack_quantized(matrix), torch.empty(m, 200))
                theirs = slower.matmul(x, slower.pack_quantized(matrix), torch.empty(m, 200))
                assert torch.equal(ours, theirs)


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4])
def test_embedding_rows_come_from_the_panels(bits):
    """A tied embedding has no copy of its own: its rows are the LM head's columns, decoded."""
    matrix = quantize(torch.randn(300, 64), bits)
    panels = kernels.pack_quantized(matrix)
    ids = torch.tensor([0, 1, 15, 16, 31, 32, 63, 64, 200, 299])
    assert torch.equal(panels.columns(ids), matrix.dequantize()[ids])
    assert torch.equal(kernels.columns(panels, ids), matrix.dequantize()[ids])  # the kernel pass's, in C
    with pytest.raises(KernelArgumentError, match="columns"):
        kernels.columns(panels, torch.tensor([300]))


def test_quantizers_bound_their_error_and_stack_to_the_wider_codes():
    """Half a step at most (q8's step is max |w| / 127, q4's (max w - min w) / 15, per group), but
    for the rounding of scales and minimums to float16 (relative 2^-11, on codes up to 127)."""
    w = torch.randn(8, 64)
    groups = w.view(8, 2, GROUP)
    steps = {8: groups.abs().amax(2) / 127, 4: (groups.amax(2) - groups.amin(2)) / 15}
    for bits, step in steps.items():
        q = quantize(w, bits)
        error = (q.dequantize() - w).abs().view(8, 2, GROUP).amax(2)
        assert (error <= step / 2 + groups.abs().amax(2) * 2 ** -10).all(), bits
        assert torch.equal(q.scales.half().float(), q.scales)  # float16 values, as the kernels hold them
    both = stack_rows([quantize(w, 4), quantize(w, 8)])
    assert both.bits == 8 and both.shape == (16, 64)
    assert torch.equal(both.dequantize()[:8], quantize(w, 4).dequantize())
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40), 8)


@needs_kernels
@pytest.mark.parametrize("target_weights, draft_weights", [("q8", "q8"), ("q4", "q8"), ("q4", "q4")])
def test_greedy_speculation_is_that_formats_plain_decoding(quantization_pair, target_weights, draft_weights):
    """Mixed batches, K 1-5, adaptive, n-gram: every output token for token the plain output of the
    target held in the same format (which differs from the float model's: it is another model)."""
    target, draft = quantization_pair
    prompts = [[3, 17, 42, 7, 99, 12, 5], [8, 8, 8, 21, 30, 8, 8, 8, 21], list(range(40, 90)), [5]]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = LocalEngine(str(target), draft=None, target_weights=target_weights).generate(prompts, params)
    expected = [o.token_ids for o in plain]
    assert LocalEngine(str(target), draft=None).target_worker.runner.model.quantized is False  # auto: floats
    runs = [dict(draft=str(draft), num_speculative_tokens=k, adaptive=False) for k in (1, 3, 5)]
    runs += [dict(draft=str(draft), num_speculative_tokens=4), dict(draft="ngram", num_speculative_tokens=3)]
    for run in runs:
        engine = LocalEngine(str(target), target_weights=target_weights, draft_weights=draft_weights, **run)
        assert [o.token_ids for o in engine.generate(prompts, params)] == expected, run


def exact_distribution_at(model_dir, weights: str, params: dict, new: int = 3) -> dict:
    """Every continuation's probability under specdec's own model in `weights` (its logits for a
    prefix are the same in any pass: the kernels are batch-invariant) and HF's logits processors."""
    model, processors = load_model(model_dir, weights=weights), hf_processors(params)

    def next_probs(ids: list[int]) -> torch.Tensor:
        cache = model.new_kv_cache(num_blocks=4, block_size=8)
        cache.add_sequence("p")
        logits = model.forward(prepare_forward(cache, ["p"], [ids], [1]), cache)
        return torch.softmax(processors(torch.tensor([ids]), logits), dim=-1)[0]

    return continuation_probs(next_probs, new, PROMPT)


@needs_kernels
@pytest.mark.parametrize("weights, drafter, params", [
    ("q4", "perturbed", dict(temperature=0.8, top_k=4)),
    ("q8", "ngram", dict(temperature=1.0)),
])
def test_sampled_speculation_follows_that_formats_distribution(tmp_path_factory, weights, drafter, params):
    target = build_checkpoint(tmp_path_factory.mktemp("qd-target"), seed=3, initializer_range=0.08, **SHAPE)
    draft = "ngram" if drafter == "ngram" else str(perturbed_copy(target, tmp_path_factory.mktemp("qd"), noise=0.8))
    dist = exact_distribution_at(target, weights, params)
    engine = LocalEngine(str(target), draft=draft, num_speculative_tokens=3, max_batch_size=1000, adaptive=False,
                         target_weights=weights, draft_weights=weights)
    samples = 2000
    outputs = engine.generate([PROMPT] * samples, [SamplingParams(max_new_tokens=3, ignore_eos=True, seed=i, **params)
                                                   for i in range(samples)])
    assert chi_square_pvalue([tuple(o.token_ids) for o in outputs], dist) > 1e-3
    assert sum(o.stats.proposed_tokens for o in outputs) > samples // 10  # speculation really happened


@needs_kernels
def test_a_float_draft_runs_as_q8_by_default_and_the_target_keeps_its_floats(quantization_pair, tmp_path):
    """A draft's numbers choose what is proposed, never what is output, so weights=auto holds a
    float draft as q8 where the kernels run (a quarter of the bytes a draft step reads); the target
    keeps its floats (its output is the float model's), a GGUF draft its file's codes."""
    def formats(engine) -> list:
        models = engine.target_worker.runner.model, engine.draft_worker.drafter.runner.model
        return [m.weights.lm_head.panels.bits if m.quantized else "fp" for m in models]

    target, draft = map(str, quantization_pair)
    q4_draft = write_gguf(quantization_pair[1], tmp_path / "draft.gguf", tmp_path / "reference", "Q4_1")
    assert formats(LocalEngine(target, draft=draft)) == ["fp", 8]
    assert formats(LocalEngine(target, draft=str(q4_draft))) == ["fp", 4]
    assert formats(LocalEngine(target, draft=draft, draft_weights="fp")) == ["fp", "fp"]
    assert formats(LocalEngine(target, draft=draft, cpu_kernels=False)) == ["fp", "fp"]  # (torch's ops)


@needs_kernels
def test_the_setting_is_checked_and_codes_need_the_kernels(quantization_pair):
    with pytest.raises(ConfigError, match="target.weights must be one of auto, fp, q8, q4"):
        LocalEngine(str(quantization_pair[0]), draft=None, target_weights="q3")
    with pytest.raises(ValueError, match="weights=q4 runs in specdec's C kernels"):
        load_model(quantization_pair[0], weights="q4", cpu_kernels=False)
    assert WorkerConfig().weights == "auto"
    model = load_model(quantization_pair[0], weights="q4")
    assert model.quantized and isinstance(model.weights.lm_head.panels.codes, torch.Tensor)
    assert isinstance(quantize(torch.randn(2, 32), 4), QuantizedMatrix)
