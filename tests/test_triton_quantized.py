"""Products by codes on a GPU (specdec.model.triton_quantized), run on this CPU by Triton's
interpreter (conftest sets TRITON_INTERPRET=1 where no GPU is present): the product is the input
times the dequantized matrix (scales and minimums applied to each group's sum), a small pass
splits its inputs by the matrix alone, embedding rows come from the codes, a model loaded as codes
where the GPU's kernels run holds no float matrix, and speculative greedy output is that format's
plain output. scripts/gpu_check.py checks the same on a GPU, bits and timings included."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from specdec import LocalEngine, SamplingParams  # noqa: E402
from specdec.model import load_model  # noqa: E402
from specdec.model.batch import prepare_forward  # noqa: E402
from specdec.model.quantized import quantize  # noqa: E402
from specdec.model.triton_quantized import DeviceCodes, quantized_product  # noqa: E402

from gguf_files import write_gguf  # noqa: E402

# Of the largest reference value: float32 sums in another order; bfloat16's output rounding (2^-9)
# and its input's (x is bfloat16 in both, so only the output's rounding remains).
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2.0 ** -7}


def reference(x: torch.Tensor, matrix, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w (+ bias) in float64, w the codes' float matrix; x and bias as the kernel reads them."""
    out = x.double() @ matrix.dequantize().double().t()
    return out if bias is None else out + bias.to(x.dtype).double()


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got.double() - want).abs().max() <= TOLERANCE[got.dtype] * want.abs().max()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_product_by_codes_is_the_input_times_the_dequantized_matrix(bits, dtype):
    """200 outputs (a partial tile of outputs), a bias; 1 and 5 rows (the batch-invariant
    configuration) and 70 (past SMALL_ROWS: the tall tiles)."""
    gen = torch.Generator().manual_seed(bits)
    matrix = quantize(torch.randn(200, 96, generator=gen) * 0.05, bits)
    bias = torch.randn(200, generator=gen)
    codes = DeviceCodes.build(matrix, bias, "cpu", dtype)
    for rows in (1, 5, 70):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        got = quantized_product(x, codes)
        assert got.dtype == dtype and got.shape == (rows, 200)
        assert_close(got, reference(x, matrix, bias))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_small_pass_splits_its_inputs_by_the_matrix_alone(bits):
    """64 outputs fill one program: the inputs' 32 groups are split four ways (at least
    MIN_GROUPS_PER_SPLIT each) whatever the rows, and the parts are added up with the bias."""
    gen = torch.Generator().manual_seed(10 + bits)
    matrix = quantize(torch.randn(64, 1024, generator=gen), bits)
    bias = torch.randn(64, generator=gen)
    codes = DeviceCodes.build(matrix, bias, "cpu", torch.float32)
    assert codes.splits == (4, 8)
    x = torch.randn(9, 1024, generator=gen)
    assert_close(quantized_product(x, codes), reference(x, matrix, bias))
    assert_close(quantized_product(x[:1], codes), reference(x[:1], matrix, bias))
    assert quantized_product(x[:0], codes).shape == (0, 64)


@pytest.mark.parametrize("bits", [8, 4])
def test_embedding_rows_are_the_codes_columns(bits):
    gen = torch.Generator().manual_seed(20 + bits)
    matrix = quantize(torch.randn(50, 64, generator=gen), bits)  # [vocab, hidden]: a tied LM head
    codes = DeviceCodes.build(matrix, None, "cpu", torch.float32)
    ids = torch.tensor([3, 0, 49, 3])
    rows = codes.columns(ids)
    assert rows.is_contiguous() and torch.equal(rows, matrix.dequantize()[ids])


def test_a_gguf_keeps_its_codes_where_the_gpu_kernels_run(quantization_pair, tmp_path, monkeypatch):
    """auto keeps a Q4_1 file's codes (no float matrix held, a third of the float model's bytes)
    and a pass's logits are the dequantized float model's; a float checkpoint keeps its floats."""
    monkeypatch.setenv("SPECDEC_ATTENTION", "triton")
    gguf = write_gguf(quantization_pair[0], tmp_path / "t.gguf", tmp_path / "reference", "Q4_1")
    model = load_model(gguf, cpu_kernels=False)
    floats = load_model(tmp_path / "reference", cpu_kernels=False)
    assert model.quantized and not floats.quantized
    assert isinstance(model.weights.embed, DeviceCodes)
    assert all(p.weight is None for layer in model.weights.layers for p in layer.projections())
    assert model.weights.nbytes < floats.weights.nbytes / 3
    logits = []
    for m in (model, floats):
        cache = m.new_kv_cache(num_blocks=8, block_size=16)
        cache.add_sequence("a")
        logits.append(m.forward(prepare_forward(cache, ["a"], [list(range(3, 40))], [37]), cache))
    assert (logits[0] - logits[1]).abs().max() <= 1e-4 * logits[1].abs().max()


def test_greedy_speculation_on_the_gpus_codes_is_that_formats_plain_decoding(quantization_pair, monkeypatch):
    """Target q4, draft q8, both multiplied by Triton's kernel; K = 3, two prompts in one batch."""
    monkeypatch.setenv("SPECDEC_ATTENTION", "triton")
    target, draft = quantization_pair
    prompts = [[3, 17, 42, 7, 99, 12, 5], list(range(40, 58))]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    settings = dict(target_weights="q4", draft_weights="q8", cpu_kernels=False, kv_cache_blocks=64)
    plain = LocalEngine(str(target), draft=None, **settings)
    assert plain.target_worker.runner.model.weights.lm_head.device_codes is not None
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    spec = LocalEngine(str(target), draft=str(draft), num_speculative_tokens=3, adaptive=False, **settings)
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    assert all(len(t) == 8 for t in expected)
