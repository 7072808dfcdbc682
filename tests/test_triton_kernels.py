"""The GPU's Triton kernels, run on this CPU by Triton's interpreter (conftest sets TRITON_INTERPRET=1
where no GPU is present, before anything imports Triton): attention over the paged cache against a
softmax per token, the fused small ops against torch's ops, whole passes against the torch path,
and the padding of replayed CUDA graphs (a replay runs eagerly on the graph's input tensors)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from specdec.model import load_model  # noqa: E402
from specdec.model.batch import prepare_forward  # noqa: E402
from specdec.model.cuda_graphs import GraphedPasses, bucket_sizes  # noqa: E402
from specdec.model.decoder import rms_norm  # noqa: E402
from specdec.model.rope import RotaryTable  # noqa: E402
from specdec.model.triton_attention import attention_splits, triton_paged_attention  # noqa: E402
from specdec.model.triton_ops import add_rms_norm, rope_and_cache, silu_mul  # noqa: E402

from checkpoints import CONFIGS, FAMILY_CONFIGS, build_checkpoint  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative to the output's largest value


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bits in float32; in bfloat16 within two units of the last place of the largest value
    (the interpreter rounds float32 to bfloat16 by truncation, a GPU to nearest: gpu_check
    compares the bits there)."""
    if got.dtype == torch.float32:
        return torch.equal(got, want)
    return bool((got.float() - want.float()).abs().max() <= want.float().abs().max() * 2.0 ** -6)


def reference_attention(q, k_cache, v_cache, tables, lens, qlens, positions, scale):
    """Each token's softmax over keys 0..position of its own sequence, in float64."""
    out, row = [], 0
    heads, kv_heads, dim, size = q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1]
    for table, length, qlen in zip(tables, lens, qlens):
        slots = [table[n // size] * size + n % size for n in range(length)]
        keys, values = (c.reshape(-1, kv_heads, dim)[slots].double() for c in (k_cache, v_cache))
        for _ in range(qlen):
            p = int(positions[row])
            heads_out = []
            for h in range(heads):
                g = h // (heads // kv_heads)
                weights = torch.softmax(q[row, h].double() @ keys[:p + 1, g].T * scale, 0)
                heads_out.append(weights @ values[:p + 1, g])
            out.append(torch.stack(heads_out))
            row += 1
    return torch.stack(out)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_scattered_pages_matches_a_softmax_per_token(dtype, splits):
    """Three sequences (a prompt chunk, a decode step, a verify pass) in one pass, grouped query
    heads, pages in random order, block tables padded; keys in one part or merged from four."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, size, blocks = 6, 2, 32, 4, 60
    k_cache = torch.randn(blocks, size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, size, kv_heads, dim, generator=gen).to(dtype)
    pages = torch.randperm(blocks, generator=gen).tolist()
    tables = [pages[:4], pages[4:6], pages[6:36]]  # the third holds more keys than a split's block
    lens, qlens = [13, 7, 119], [9, 1, 5]
    positions = torch.tensor([*range(4, 13), 6, *range(114, 119)])
    q = torch.randn(sum(qlens), heads, dim, generator=gen).to(dtype)
    padded = torch.tensor([t + [0] * (30 - len(t)) for t in tables])
    got = triton_paged_attention(q, k_cache, v_cache, padded, torch.tensor(lens), torch.tensor([0, 9, 10, 15]),
                                 positions, max(qlens), dim ** -0.5, splits=splits)
    want = reference_attention(q, k_cache, v_cache, tables, lens, qlens, positions, dim ** -0.5)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.double() - want).abs().max() <= TOLERANCE[dtype] * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_small_ops_round_as_torchs_ops_do(dtype):
    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, dim, width = 5, 4, 2, 16, 48
    x, delta = (torch.randn(tokens, width, generator=gen).to(dtype) for _ in range(2))
    weight = (1 + torch.randn(width, generator=gen) / 4).to(dtype)
    stream = x.clone()
    h = add_rms_norm(stream, delta, weight, 1e-5)
    summed = x + delta
    assert same(stream, summed)  # the residual add, in place
    want = rms_norm(summed, weight, 1e-5)  # the torch path's norm
    assert (h.float() - want.float()).abs().max() <= TOLERANCE[dtype] * want.float().abs().max()

    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    angles = torch.outer(torch.arange(64.0), torch.rand(dim // 2, generator=gen)).repeat(1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions, slots = torch.tensor([3, 9, 40, 41, 0]), torch.tensor([7, 2, 30, 31, 0])
    k_cache, v_cache = (torch.zeros(8, 4, kv_heads, dim, dtype=dtype) for _ in range(2))
    q = rope_and_cache(qkv, cos, sin, positions, slots, k_cache, v_cache, heads, kv_heads)
    split = qkv.view(tokens, heads + 2 * kv_heads, dim)
    rotated = RotaryTable.apply(split, cos[positions][:, None], sin[positions][:, None])  # the torch path's
    assert same(q, rotated[:, :heads])
    assert same(k_cache.view(-1, kv_heads, dim)[slots], rotated[:, heads:heads + kv_heads])
    assert torch.equal(v_cache.view(-1, kv_heads, dim)[slots], split[:, heads + kv_heads:])

    gate_up = torch.randn(tokens, 2 * width, generator=gen).to(dtype)
    gate, up = gate_up.chunk(2, -1)
    want = torch.nn.functional.silu(gate) * up
    assert (silu_mul(gate_up).float() - want.float()).abs().max() <= TOLERANCE[dtype] * want.float().abs().max()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("triton"), seed=0, **CONFIGS["gqa_untied"])


def passes(model, cache, run):
    """Prefill of two ragged prompts, a verify-shaped pass, decode steps: each pass's logits."""
    for seq in "ab":
        cache.add_sequence(seq)
    out = [run(["a", "b"], [list(range(1, 20)), [5, 6]], [19, 1])]
    out.append(run(["a", "b"], [[7, 8, 9], [1, 2, 3]], [3, 3]))
    for step in range(3):
        out.append(run(["a", "b"], [[step + 4], [step + 9]], [1, 1]))
    out.append(run(["b"], [[3]], [1]))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2_untied", "qwen3_tied"])
def test_a_pass_on_the_gpu_kernels_matches_the_torch_path(family, checkpoint, tmp_path, monkeypatch):
    """Llama and Qwen2 (q/k/v biases) on the fused kernels; Qwen3 (per-head q/k norms) on torch's
    ops with Triton's attention."""
    if family != "llama":
        settings = dict(FAMILY_CONFIGS[family])
        checkpoint = build_checkpoint(tmp_path, seed=0, family=settings.pop("family"), **settings)
    monkeypatch.setenv("SPECDEC_ATTENTION", "torch")
    reference = load_model(checkpoint, cpu_kernels=False)
    monkeypatch.setenv("SPECDEC_ATTENTION", "triton")
    model = load_model(checkpoint, cpu_kernels=False)
    assert model.attention == "triton" and model.fused_ops == (family != "qwen3_tied")
    assert (model.weights.layers[0].qk_norm is not None) == (family == "qwen3_tied")
    caches = [m.new_kv_cache(num_blocks=24, block_size=8) for m in (reference, model)]
    want = passes(reference, caches[0], lambda *a: reference.forward(prepare_forward(caches[0], *a), caches[0]))
    got = passes(model, caches[1], lambda *a: model.forward(prepare_forward(caches[1], *a), caches[1]))
    for g, w in zip(got, want):
        assert g.shape == w.shape and (g - w).abs().max() <= 1e-4


def test_replayed_passes_pad_into_a_block_no_sequence_owns(checkpoint, monkeypatch):
    """Two sequences in a bucket of 2, then one (a padding row); a verify pass of 3: every replay
    equals the eager pass, and the padding writes only the reserved block."""
    monkeypatch.setenv("SPECDEC_ATTENTION", "triton")
    model = load_model(checkpoint, cpu_kernels=False)
    eager_cache, graph_cache = (model.new_kv_cache(num_blocks=24, block_size=8) for _ in range(2))
    eager_cache.reserve_block()  # both caches hand the sequences the same blocks
    graphs = GraphedPasses(model, graph_cache, max_batch=3, capture=False)
    assert graphs.buckets == [1, 2, 4] and graph_cache.reserved == [graphs.scratch_block]
    want = passes(model, eager_cache, lambda *a: model.forward(prepare_forward(eager_cache, *a), eager_cache))
    got = passes(model, graph_cache, lambda *a: graphs.forward(prepare_forward(graph_cache, *a)))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert graphs.replays == 5 and sorted(graphs._captured) == [(1, 1), (2, 1), (2, 3)]
    for seq in "ab":
        assert graphs.scratch_block not in graph_cache.block_table(seq)
        table = graph_cache.block_table(seq)
        assert table == eager_cache.block_table(seq) and torch.equal(graph_cache.k[:, table], eager_cache.k[:, table])
    graph_cache.check_accounting()


def test_ragged_passes_replay_padded_to_their_longest_sequence(checkpoint, monkeypatch):
    """Verify passes where two requests drafted different K (4 and 2 new tokens, then 1 and 3, then
    3 and 1 with a third sequence's single token), and a draft's catch-up (2 and 1 tokens, logits
    for the last only): each replays the graph of its longest sequence, its logits equal the eager
    pass's, and the missing tokens write only the reserved block. A prompt longer than a block
    runs eagerly."""
    monkeypatch.setenv("SPECDEC_ATTENTION", "triton")
    model = load_model(checkpoint, cpu_kernels=False)
    eager_cache, graph_cache = (model.new_kv_cache(num_blocks=24, block_size=8) for _ in range(2))
    eager_cache.reserve_block()
    graphs = GraphedPasses(model, graph_cache, max_batch=3, capture=False)

    def ragged(cache, run):
        for seq in "abc":
            cache.add_sequence(seq)
        out = [run(["a", "b", "c"], [list(range(1, 14)), [5, 6, 7], [8, 9]], [1, 1, 1])]  # prefill: eager
        out.append(run(["a", "b"], [[7, 8, 9, 10], [1, 2]], [4, 2]))
        out.append(run(["a", "b"], [[11], [3, 4, 5]], [1, 3]))
        out.append(run(["a", "b", "c"], [[12, 13, 14], [6], [9]], [3, 1, 1]))
        out.append(run(["a", "b"], [[15, 16], [7]], [1, 1]))
        return out

    want = ragged(eager_cache, lambda *a: model.forward(prepare_forward(eager_cache, *a), eager_cache))
    got = ragged(graph_cache, lambda *a: graphs.forward(prepare_forward(graph_cache, *a)))
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)
    assert graphs.replays == 4 and sorted(graphs._captured) == [(2, 2), (2, 3), (2, 4), (4, 3)]
    for seq in "abc":
        table = graph_cache.block_table(seq)
        assert graphs.scratch_block not in table and table == eager_cache.block_table(seq)
        assert torch.equal(graph_cache.k[:, table], eager_cache.k[:, table])
    graph_cache.check_accounting()


def test_every_bucket_and_query_length_is_prepared_before_the_first_pass(checkpoint, monkeypatch, caplog):
    """capture_all: a graph for each bucket and each q up to a block (at most 16), so no round
    meets a capture (whose time the adaptive policy would learn as the round's cost); the worker's
    log says how many and how long (seconds at a start)."""
    monkeypatch.setenv("SPECDEC_ATTENTION", "triton")
    model = load_model(checkpoint, cpu_kernels=False)
    graphs = GraphedPasses(model, model.new_kv_cache(num_blocks=24, block_size=8), max_batch=3, capture=False)
    with caplog.at_level("INFO", logger="specdec.model.cuda_graphs"):
        graphs.capture_all()
    assert sorted(graphs._captured) == [(b, q) for b in (1, 2, 4) for q in range(1, 9)]
    assert "CUDA graphs for batches up to 4 and 1-8 new tokens a sequence: 24, captured in" in caplog.text


def test_small_grids_split_the_keys_to_fill_the_multiprocessors():
    assert attention_splits(8, 132) == 16 and attention_splits(64, 132) == 8 and attention_splits(300, 132) == 1
    assert attention_splits(1, 1) == 2 and attention_splits(2, 1) == 1


def test_buckets_grow_by_eight_past_eight():
    assert bucket_sizes(1) == [1] and bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 24] and bucket_sizes(32) == [1, 2, 4, 8, 16, 24, 32]


def test_speculative_greedy_equals_plain_greedy_on_the_gpu_kernels(checkpoint, tmp_path, monkeypatch):
    """The GPU's path end to end (scheduler, drafter, verifier) on the interpreter: another random
    model of the same shape drafts, at K = 3, two prompts at once; the tokens are the target's own."""
    from coordinator.rounds.request import Request
    from coordinator.rounds.scheduler import Scheduler
    from draft_worker.worker import DraftWorker
    from specdec.config import ServiceConfig
    from specdec.params import SamplingParams
    from target_worker.worker import TargetWorker

    monkeypatch.setenv("SPECDEC_ATTENTION", "triton")
    draft = build_checkpoint(tmp_path / "draft", seed=1, **CONFIGS["gqa_untied"])

    def generate(draft_spec):
        config = ServiceConfig.from_settings(target=str(checkpoint), draft=draft_spec, cpu_kernels=False,
                                             kv_cache_blocks=64, num_speculative_tokens=3, adaptive=False)
        sched = Scheduler(TargetWorker.from_config(config.target),
                          DraftWorker.from_config(config.draft) if draft_spec else None, None, config.scheduler)
        assert sched.target.runner.model.fused_ops
        out = {"a": [], "b": []}
        for name, prompt in (("a", [5, 9, 2, 7]), ("b", list(range(20, 31)))):
            sched.add_request(Request(name, prompt, SamplingParams(max_new_tokens=10, ignore_eos=True)))
        while sched.has_work() or sched.running:
            for update in sched.step().updates:
                assert update.error is None
                out[update.req_id] += update.token_ids
        return out

    plain = generate(None)
    assert generate(str(draft)) == plain and all(len(t) == 10 for t in plain.values())
