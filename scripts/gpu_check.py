#!/usr/bin/env python
"""Every GPU claim of specdec in one run, on a bare CUDA machine (issue 24).

Needs only torch and transformers: run it from the checkout, no install, no Ray, no grpc:

    PYTHONPATH=. python scripts/gpu_check.py --out /tmp/gpu        # on a GPU (under 8 minutes)
    PYTHONPATH=. python scripts/gpu_check.py --device cpu --quick  # the same checks here (CI)

It writes <out>/gpu_check.json and <out>/gpu_check.md, section by section (a section that fails
records its error and the rest still run; a run cut short keeps what it measured):
- smoke: the GPU pieces one by one (fused ops, Triton's attention, a captured graph); a piece that
  fails is turned off for the sections after it;
- fused ops: each Triton kernel of model.triton_ops against torch's ops, bit for bit;
- parity: our logits against Hugging Face's, float32 and bfloat16 (and bfloat16's own error: HF's
  bfloat16 against its float32), and Triton's path against torch's on the same model;
- exactness: speculative greedy == the target's own greedy (float32 and bfloat16), with CUDA
  graphs and without; a mixed sampled batch (top_k 0 / 5 / 50, top_p) with overlapped drafting,
  reproduced from its seeds; host syncs (.item / .tolist / .cpu / bool()) per round, counted;
- graphs: a replayed pass against the same pass run eagerly, at a padded bucket;
- families: Qwen2 (biases) and Qwen3 (per-head q/k norms) against Hugging Face, replay vs eager;
- timings on random-weight models of the reference pair's shapes (Llama-3.2-1B drafting for 3B,
  bfloat16; tiny shapes in --quick), eager and replayed from graphs: a plain step against the
  memory floor (weight bytes / the measured copy bandwidth), the draft step's cost ratio c, a
  6-token verify pass against a step, the speedups those predict at acceptance 0.6 and 0.8, the
  kernels of a step (profiler), the KV cache at kv_memory_fraction 0.5 and whether its largest
  pass stays within the measured headroom;
- long prompt: 131071 tokens (Llama-3.2's context) through the runner on the 3B shape: time, peak;
- shipped: the shipped pair's measured speedup (float32);
- quantized: weights held as q8 and q4 codes (model.triton_quantized): speculative greedy == that
  format's plain greedy (float32 and bfloat16, graphs on and off); a row's product bits alone and
  in a batch; the reference shapes' graphed step, verify and draft step at each format, their
  weight bytes and the draft's cost ratio c;
- trees: token trees' greedy == the target's greedy (fixed and adaptive, float32 and bfloat16), a
  seeded sampled tree batch reproduces; a tree's verify pass against a chain's and a step;
- policy: plain, every fixed K and the adaptive engine (chains and trees) side by side on the
  shipped pair and on an "echo" pair whose drafting pays on a GPU, batch 1 and 8, greedy and T=0.8:
  the policy on a machine it was not tuned on.
`--only a,b` runs only the sections named.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coordinator.rounds.request import Request  # noqa: E402
from coordinator.rounds.scheduler import Scheduler  # noqa: E402
from draft_worker.worker import DraftWorker  # noqa: E402
from specdec.config import SHIPPED_DRAFT, SHIPPED_TARGET, ServiceConfig, WorkerConfig  # noqa: E402
from specdec.model import load_model  # noqa: E402
from specdec.model.batch import TreeNodes, prepare_forward  # noqa: E402
from specdec.model.config import ModelConfig  # noqa: E402
from specdec.model.cuda_graphs import GraphedPasses  # noqa: E402
from specdec.model.decoder import CPU_HALF_PRECISION_ENV, Model, rms_norm  # noqa: E402
from specdec.model.memory_budget import CudaMemory, accelerator_num_blocks, activation_headroom  # noqa: E402
from specdec.model.rope import RotaryTable  # noqa: E402
from specdec.model.runner import ModelRunner  # noqa: E402
from specdec.model.weights import build_weights  # noqa: E402
from specdec.params import SamplingParams  # noqa: E402
from specdec.sampling.tree import leading_chain, node_paths  # noqa: E402
from target_worker.worker import TargetWorker  # noqa: E402

# The reference pair's shapes (Llama-3.2-1B / 3B-Instruct), and tiny ones for --quick.
SHAPES = {
    "1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "3B": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, vocab_size=128256),
    "tiny-draft": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512),
    "tiny-target": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_model(shape: dict, device: torch.device, dtype: torch.dtype, context: int = 4096,
                 weight_format: str = "fp") -> Model:
    """A model of this shape with random weights made on the device (no checkpoint on disk),
    its matrices held in `weight_format` (fp, q8 or q4: model.quantized)."""
    raw = {"model_type": "llama", "max_position_embeddings": context, "tie_word_embeddings": True, **shape}
    config = ModelConfig.from_dict(raw)
    hidden, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    gen = torch.Generator(device=device).manual_seed(0)

    def w(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=dtype) * 0.02

    def ones(size):
        return torch.ones(size, device=device, dtype=dtype)

    tensors = {"embed_tokens.weight": w(config.vocab_size, hidden), "norm.weight": ones(hidden)}
    for i in range(config.num_hidden_layers):
        p, attn, mlp, inter = f"layers.{i}", f"layers.{i}.self_attn", f"layers.{i}.mlp", config.intermediate_size
        tensors.update({f"{p}.input_layernorm.weight": ones(hidden),
                        f"{p}.post_attention_layernorm.weight": ones(hidden),
                        f"{attn}.q_proj.weight": w(hidden, hidden), f"{attn}.k_proj.weight": w(kv, hidden),
                        f"{attn}.v_proj.weight": w(kv, hidden), f"{attn}.o_proj.weight": w(hidden, hidden),
                        f"{mlp}.gate_proj.weight": w(inter, hidden), f"{mlp}.up_proj.weight": w(inter, hidden),
                        f"{mlp}.down_proj.weight": w(hidden, inter)})
    weights = build_weights(config, tensors, device, dtype, packed=False, weight_format=weight_format)
    return Model(config, weights, device, dtype)


def timed_pass(model: Model, batch: int, tokens: int, context: int, repeats: int, graphed: bool = False,
               replay_only: dict | None = None, parents: list[int] | None = None) -> float:
    """Median seconds of a pass feeding `tokens` new tokens to each of `batch` sequences of
    `context`, preparing the batch included (host work a round pays); graphed: through
    model.cuda_graphs (captured in an untimed first pass), and then `replay_only["s"]` gets the
    median of the graph's replay alone. parents: a verify pass of a token tree instead (the last
    committed token, then the tree's nodes; sampling.tree's parent list), eager as the runner
    runs trees."""
    device = model.device
    trees = None
    if parents is not None:
        tokens, tree_start = 1 + len(parents), context + 1
        trees = [TreeNodes(tree_start, node_paths(parents, tree_start)[leading_chain(parents):])] * batch
    cache = model.new_kv_cache(num_blocks=batch * (context + tokens * (repeats + 2)) // 16 + batch * 2 + 1,
                               block_size=16)
    graphs = GraphedPasses(model, cache, max_batch=batch) if graphed else None
    ids = [str(i) for i in range(batch)]
    for s in ids:
        cache.add_sequence(s)
    model.forward(prepare_forward(cache, ids, [[1] * context] * batch, [1] * batch), cache)
    times = []
    for _ in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        forward = prepare_forward(cache, ids, [[2] * tokens] * batch, [tokens] * batch, trees)
        graphs.forward(forward) if graphs else model.forward(forward, cache)
        sync(device)
        times.append(time.perf_counter() - start)
        for s in ids:
            cache.truncate_to(s, context)
    if graphs is not None and replay_only is not None:
        (captured,) = graphs._captured.values()
        replays = []
        for _ in range(repeats):
            start = time.perf_counter()
            captured.graph.replay()
            sync(device)
            replays.append(time.perf_counter() - start)
        replay_only["s"] = sorted(replays)[len(replays) // 2]
    times = times[1:]  # the first captured the graph
    return sorted(times)[len(times) // 2]


def kernel_profile(model: Model, context: int) -> dict:
    """The GPU kernels of one eager batch-1 step: their summed time and the five longest."""
    from torch.profiler import ProfilerActivity, profile

    cache = model.new_kv_cache(num_blocks=context // 16 + 4, block_size=16)
    cache.add_sequence("p")
    model.forward(prepare_forward(cache, ["p"], [[1] * context], [1]), cache)
    model.forward(prepare_forward(cache, ["p"], [[2]], [1]), cache)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.forward(prepare_forward(cache, ["p"], [[3]], [1]), cache)
        sync(model.device)
    events = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0]
    events.sort(key=lambda e: -e.device_time_total)
    return {"eager_step_kernel_seconds": sum(e.device_time_total for e in events) / 1e6,
            "eager_step_kernel_launches": sum(e.count for e in events),
            "eager_step_top_kernels": [(e.key[:60], e.count, round(e.device_time_total)) for e in events[:6]]}


def copy_bandwidth(device: torch.device, megabytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write) of a large buffer."""
    src = torch.empty(megabytes << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    sync(device)
    return 2 * 5 * src.numel() / (time.perf_counter() - start)


@contextmanager
def counted_host_syncs():
    """Counts the calls that move a tensor's values to the host (on a GPU each waits for it)."""
    counts = {"n": 0}
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "cpu", "__bool__")}

    def wrap(original):
        def counting(self, *args, **kwargs):
            counts["n"] += 1
            return original(self, *args, **kwargs)
        return counting

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def scheduler(target: str, draft: str | None, device: str, dtype: str, **settings) -> Scheduler:
    config = ServiceConfig.from_settings(target=target, draft=draft, device=device, dtype=dtype,
                                         kv_cache_blocks=512, **settings)
    return Scheduler(TargetWorker.from_config(config.target),
                     DraftWorker.from_config(config.draft) if draft else None, None, config.scheduler)


def generate(sched: Scheduler, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list, int]:
    """Tokens per prompt and the rounds it took."""
    out = {f"r{i}": [] for i in range(len(prompts))}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        sched.add_request(Request(f"r{i}", p, sp))
    rounds = 0
    while sched.has_work() or sched.running:
        for update in sched.step().updates:
            assert update.error is None, update.error
            out[update.req_id] += update.token_ids
        rounds += 1
    return [out[f"r{i}"] for i in range(len(prompts))], rounds


def tiny_pair(tmp: Path):
    """A random tiny Llama target (saved as a checkpoint) and a noisy copy of it as the draft."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # (the check's reference)

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      initializer_range=0.2)).eval()
    hf.save_pretrained(tmp / "target")
    noisy = AutoModelForCausalLM.from_pretrained(tmp / "target")
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn_like(p) * 0.1 * p.std())
    noisy.save_pretrained(tmp / "draft")


def smoke(dev: torch.device, tmp: Path) -> dict:
    """The GPU pieces one by one on the tiny target (a pass with fused ops, with Triton's attention
    alone, then a captured graph). A piece that fails is turned off for the sections after it, so
    they measure what does run, and the report names the failure."""
    import specdec.model.decoder as decoder
    import specdec.model.runner as runner
    import specdec.model.triton_ops as triton_ops

    if dev.type != "cuda":
        return {}
    report = {}

    def one_pass(graphed: bool = False) -> None:
        model = load_model(tmp / "target", device=str(dev), dtype="bfloat16")
        cache = model.new_kv_cache(num_blocks=16, block_size=16)
        cache.add_sequence("a")
        model.forward(prepare_forward(cache, ["a"], [list(range(1, 30))], [1]), cache)
        if graphed:
            GraphedPasses(model, cache, max_batch=2).forward(prepare_forward(cache, ["a"], [[3]], [1]))
        sync(dev)

    for piece, turn_off in (("fused_ops", lambda: setattr(triton_ops, "fused_ops_fit", lambda dim: False)),
                            ("triton_attention", lambda: setattr(decoder, "triton_available", lambda: False))):
        try:
            one_pass()
            break
        except Exception as error:
            report[f"smoke_{piece}_failed"] = "".join(traceback.format_exception(error)[-4:])[-1200:]
            turn_off()
    try:
        one_pass(graphed=True)
    except Exception as error:
        report["smoke_cuda_graphs_failed"] = "".join(traceback.format_exception(error)[-4:])[-1200:]
        runner.GraphedPasses = lambda *args, **kwargs: None
    return report


def fused_ops(dev: torch.device) -> dict:
    """Each fused kernel (model.triton_ops) against torch's ops on random bfloat16 rows of the 3B
    shape: the largest difference, and whether the bits are equal."""
    if dev.type != "cuda":
        return {}
    from specdec.model.triton_ops import add_rms_norm, rope_and_cache, silu_mul

    gen = torch.Generator(device=dev).manual_seed(3)
    bf16 = torch.bfloat16
    tokens, heads, kv_heads, dim, width = 6, 24, 8, 128, 3072

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev).to(bf16)

    report = {}
    x, delta, weight = randn(tokens, width), randn(tokens, width), 1 + randn(width) / 4
    stream = x.clone()
    h = add_rms_norm(stream, delta, weight, 1e-5)
    summed = x + delta
    want = rms_norm(summed, weight, 1e-5)  # the torch path's norm
    report["fused_residual_add_bits_equal"] = torch.equal(stream, summed)
    report["fused_rms_norm_max_abs"] = float((h.float() - want.float()).abs().max())
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim)
    angles = torch.outer(torch.arange(4096.0, device=dev), torch.rand(dim // 2, generator=gen, device=dev)).repeat(1, 2)
    cos, sin = angles.cos().to(bf16), angles.sin().to(bf16)
    positions = torch.tensor([3, 9, 400, 401, 4000, 0], device=dev)
    slots = torch.tensor([7, 2, 30, 31, 60, 0], device=dev)
    k_cache, v_cache = (torch.zeros(8, 16, kv_heads, dim, dtype=bf16, device=dev) for _ in range(2))
    q = rope_and_cache(qkv, cos, sin, positions, slots, k_cache, v_cache, heads, kv_heads)
    split = qkv.view(tokens, heads + 2 * kv_heads, dim)
    rotated = RotaryTable.apply(split, cos[positions][:, None], sin[positions][:, None])  # the torch path's
    keys, values = (cache.view(-1, kv_heads, dim)[slots] for cache in (k_cache, v_cache))
    report["fused_rope_bits_equal"] = (torch.equal(q, rotated[:, :heads])
                                       and torch.equal(keys, rotated[:, heads:-kv_heads])
                                       and torch.equal(values, split[:, heads + kv_heads:]))
    report["fused_rope_max_abs"] = float((q.float() - rotated[:, :heads].float()).abs().max())
    gate_up = randn(tokens, 2 * 8192)
    gate, up = gate_up.chunk(2, -1)
    want = torch.nn.functional.silu(gate) * up
    got = silu_mul(gate_up)
    report["fused_silu_mul_bits_equal"] = torch.equal(got, want)
    report["fused_silu_mul_max_abs"] = float((got.float() - want.float()).abs().max())
    return report


def parity(dev: torch.device, tmp: Path) -> dict:
    """Our logits against Hugging Face's, and (on a GPU) Triton's attention against torch's."""
    from transformers import AutoModelForCausalLM

    report = {}
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    hf = {}
    for dtype in ("float32", "bfloat16"):
        ref = AutoModelForCausalLM.from_pretrained(tmp / "target", torch_dtype=getattr(torch, dtype)).to(dev).eval()
        with torch.no_grad():
            hf[dtype] = ref(ids.to(dev)).logits[0].float()
    # bfloat16's own error: Hugging Face's bfloat16 logits against its float32 ones
    report["hf_bfloat16_vs_float32_max_abs"] = float((hf["bfloat16"] - hf["float32"]).abs().max())
    for dtype in ("float32", "bfloat16"):
        ours = load_model(tmp / "target", device=str(dev), dtype=dtype)
        cache = ours.new_kv_cache(num_blocks=8, block_size=16)
        cache.add_sequence("a")
        got = ours.forward(prepare_forward(cache, ["a"], [ids[0].tolist()], [64]), cache)
        report[f"parity_{dtype}_max_abs"] = float((got - hf[dtype]).abs().max())
        report[f"ours_{dtype}_vs_hf_float32_max_abs"] = float((got - hf["float32"]).abs().max())
        report[f"attention_{dtype}"] = ours.attention + (" + fused ops" if ours.fused_ops else "")
        if ours.attention == "triton":  # the same model and cache through torch's ops and attention
            ours.attention, ours.fused_ops = "torch", False
            cache.truncate_to("a", 0)
            torch_path = ours.forward(prepare_forward(cache, ["a"], [ids[0].tolist()], [64]), cache)
            report[f"triton_vs_torch_path_{dtype}_max_abs"] = float((got - torch_path).abs().max())
    # Our bfloat16 is as close to float32 as Hugging Face's bfloat16 is (up to 2x its error).
    report["bfloat16_as_close_to_float32_as_hf"] = (report["ours_bfloat16_vs_hf_float32_max_abs"]
                                          <= 2 * report["hf_bfloat16_vs_float32_max_abs"])
    return report


def exactness(device: str, tmp: Path) -> dict:
    """Speculative greedy == plain greedy; a mixed sampled batch with overlap; host syncs."""
    report = {}
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 20, 33)]
    greedy = [SamplingParams(max_new_tokens=32, ignore_eos=True)] * 3
    for dtype in ("float32", "bfloat16"):
        plain, _ = generate(scheduler(str(tmp / "target"), None, device, dtype), prompts, greedy)
        sched = scheduler(str(tmp / "target"), str(tmp / "draft"), device, dtype, adaptive=False)
        spec, _ = generate(sched, prompts, greedy)
        report[f"speculative_greedy_equals_target_greedy_{dtype}"] = spec == plain
        graphs = sched.target.runner.graphs
        report[f"cuda_graph_replays_{dtype}"] = graphs.replays if graphs else 0
        eager, _ = generate(scheduler(str(tmp / "target"), str(tmp / "draft"), device, dtype, adaptive=False,
                                      cuda_graph_max_batch=0), prompts, greedy)
        report[f"graphs_on_equals_graphs_off_greedy_{dtype}"] = eager == spec
    mixed = [SamplingParams(max_new_tokens=24, temperature=0.8, top_k=k, top_p=p, seed=i, ignore_eos=True)
             for i, (k, p) in enumerate([(0, 1.0), (5, 1.0), (50, 0.9)])]
    sched = scheduler(str(tmp / "target"), str(tmp / "draft"), device, "float32", adaptive=False, overlap=True)
    with counted_host_syncs() as syncs:
        sampled, rounds = generate(sched, prompts, mixed)
    report["mixed_sampled_batch_with_overlap_lengths"] = [len(t) for t in sampled]
    report["host_syncs_per_round"] = syncs["n"] / max(rounds, 1)
    again, _ = generate(scheduler(str(tmp / "target"), str(tmp / "draft"), device, "float32", adaptive=False,
                                  overlap=True), prompts, mixed)
    report["seeded_sampled_batch_reproduces"] = again == sampled
    return report


def graph_replay(dev: torch.device, checkpoint: Path) -> dict:
    """A replayed pass against the same pass run eagerly, at a padded bucket, decode and verify."""
    if dev.type != "cuda":
        return {"cuda_graphs": "not captured: CUDA only (tests/test_triton_kernels.py checks the padding on the CPU)"}
    report = {}
    for dtype in ("float32", "bfloat16"):
        model = load_model(checkpoint, device=str(dev), dtype=dtype)
        caches = [model.new_kv_cache(num_blocks=64, block_size=16) for _ in range(2)]
        graphs = GraphedPasses(model, caches[1], max_batch=8)
        caches[0].reserve_block()  # both caches hand out the same blocks
        prompts = [[5 + i] * (9 + 7 * i) for i in range(3)]
        worst = 0.0
        for cache in caches:
            for i in range(3):
                cache.add_sequence(f"s{i}")
            model.forward(prepare_forward(cache, ["s0", "s1", "s2"], prompts, [1, 1, 1]), cache)
        for step in range(4):
            for tokens in ([[step + 1]] * 3, [[step + 2] * 4] * 3):
                ids = ["s0", "s1", "s2"]
                n = [len(tokens[0])] * 3
                eager = model.forward(prepare_forward(caches[0], ids, tokens, n), caches[0])
                replayed = graphs.forward(prepare_forward(caches[1], ids, tokens, n))
                worst = max(worst, float((eager - replayed).abs().max()))
        report[f"graph_replay_vs_eager_{dtype}_max_abs"] = worst
        report[f"graphs_captured_{dtype}"] = graphs.num_graphs
    return report


def families(dev: torch.device, tmp: Path) -> dict:
    """Qwen2 (q/k/v biases: the fused path) and Qwen3 (per-head q/k norms: torch's ops with
    Triton's attention) on the device: logits against Hugging Face's (float32), replay vs eager."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    report = {}
    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024)
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(4))
    for name, config, model_class in (("qwen2", Qwen2Config(**shape), Qwen2ForCausalLM),
                                      ("qwen3", Qwen3Config(**shape, head_dim=32), Qwen3ForCausalLM)):
        torch.manual_seed(0)
        model_class(config).eval().save_pretrained(tmp / name)
        ours = load_model(tmp / name, device=str(dev), dtype="float32")
        with torch.no_grad():
            want = AutoModelForCausalLM.from_pretrained(tmp / name).to(dev).eval()(ids.to(dev)).logits[0].float()
        cache = ours.new_kv_cache(num_blocks=8, block_size=16)
        cache.add_sequence("a")
        got = ours.forward(prepare_forward(cache, ["a"], [ids[0].tolist()], [40]), cache)
        report[f"{name}_parity_float32_max_abs"] = float((got - want).abs().max())
        report[f"{name}_path"] = ("C kernels" if ours.kernels is not None else "fused kernels" if ours.fused_ops
                                  else f"torch ops, {ours.attention} attention")
        report.update({f"{name}_{key}": value for key, value in graph_replay(dev, tmp / name).items()})
    return report


def long_prompt(dev: torch.device, quick: bool) -> dict:
    """A prompt at the context limit of the 3B shape (Llama-3.2's 131072 positions) through the
    runner (KV sized from the device's memory, chunked prefill): its peak memory and time."""
    if dev.type != "cuda":
        return {"long_prompt": "not measured on the CPU (tests/test_prefill_and_half_precision.py chunks)"}
    context = 131072
    model = random_model(SHAPES["3B"], dev, torch.bfloat16, context=context)
    torch.cuda.reset_peak_memory_stats(dev)
    config = WorkerConfig(device=str(dev), dtype="bfloat16", kv_memory_fraction=0.4, prefill_chunk_tokens=2048)
    runner = ModelRunner(model, config)
    runner.cache.add_sequence("long")
    prompt = torch.randint(0, 128000, (context - 1,), generator=torch.Generator().manual_seed(2)).tolist()
    sync(dev)
    start = time.perf_counter()
    logits = runner.run(["long"], [prompt], [1])[0]
    sync(dev)
    return {"long_prompt_tokens": len(prompt), "long_prompt_seconds": time.perf_counter() - start,
            "long_prompt_peak_gib": torch.cuda.max_memory_allocated(dev) / 2 ** 30,
            "long_prompt_kv_blocks": runner.cache.allocator.num_blocks,
            "long_prompt_logits_finite": bool(torch.isfinite(logits).all())}


def shipped_pair(device: str, quick: bool) -> dict:
    if not (SHIPPED_TARGET / "model.safetensors").exists():
        return {}
    shipped = [torch.randint(0, 4000, (40,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]
    runs = {}
    for name, draft in (("plain", None), ("speculative", str(SHIPPED_DRAFT))):
        sched = scheduler(str(SHIPPED_TARGET), draft, device, "float32", num_speculative_tokens=4)
        params = SamplingParams(max_new_tokens=48 if quick else 128, ignore_eos=True)
        generate(sched, shipped, [SamplingParams(max_new_tokens=16, ignore_eos=True)] * 4)  # warm-up: same shapes
        start = time.perf_counter()
        tokens, _ = generate(sched, shipped, [params] * 4)
        runs[name] = sum(map(len, tokens)) / (time.perf_counter() - start)
    return {"shipped_pair_plain_tok_s": runs["plain"],
            "shipped_pair_speedup_b1_greedy": runs["speculative"] / runs["plain"]}


def echo_checkpoint(path: Path, shape: dict, dev: torch.device, seed: int) -> Path:
    """A Llama checkpoint (bfloat16, tied embedding) whose layers barely touch the residual stream
    (weights 0.0005 beside the embedding's 0.02): its logits are the normed last token's products
    with the embedding, whose largest is that token's own row, so greedy repeats the last token.
    Two such models of any shapes agree on that: a pair whose drafting pays at the real shapes'
    costs (greedy acceptance ~1; at T = 0.8 the small model's softmax spreads over the vocabulary
    and acceptance falls to what it puts on the repeated token)."""
    from safetensors.torch import save_file

    gen = torch.Generator(device=dev).manual_seed(seed)
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * hidden // shape["num_attention_heads"]

    def w(*size, scale=0.0005):
        return (torch.randn(*size, generator=gen, device=dev) * scale).to(torch.bfloat16).cpu()

    tensors = {"model.embed_tokens.weight": w(shape["vocab_size"], hidden, scale=0.02),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(shape["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        tensors.update({f"{layer}.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                        f"{layer}.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                        **{f"{layer}.self_attn.{name}_proj.weight": w(rows, cols) for name, rows, cols in (
                            ("q", hidden, hidden), ("k", kv, hidden), ("v", kv, hidden), ("o", hidden, hidden))},
                        **{f"{layer}.mlp.{name}_proj.weight": w(rows, cols) for name, rows, cols in (
                            ("gate", inter, hidden), ("up", inter, hidden), ("down", hidden, inter))}})
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "hidden_act": "silu",
        "torch_dtype": "bfloat16"}))
    return path


def tokens_per_second(sched: Scheduler, prompts: list[list[int]], params: SamplingParams, batch: int) -> tuple:
    """Tokens/s of the prompts run `batch` at a time, the tokens, and the new tokens per request and
    round (1 at K = 0)."""
    tokens, rounds, start = [], 0, time.perf_counter()
    for group in range(0, len(prompts), batch):
        out, group_rounds = generate(sched, prompts[group:group + batch], [params] * batch)
        tokens += out
        rounds += group_rounds * batch
    return sum(map(len, tokens)) / (time.perf_counter() - start), tokens, sum(map(len, tokens)) / rounds


def trees(dev: torch.device, tmp: Path, quick: bool) -> dict:
    """Token trees on the device: greedy == the target's greedy (a fixed tree and the adaptive
    engine's trees, float32 and bfloat16), a seeded sampled tree batch reproduces; then a tree's
    verify pass against a chain's of as many tokens and against a step (eager: the runner does not
    graph trees), on the target's shape."""
    report = {}
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 20, 33)]
    greedy = [SamplingParams(max_new_tokens=32, ignore_eos=True)] * 3
    pair = (str(tmp / "target"), str(tmp / "draft"))
    for dtype in ("float32", "bfloat16"):
        plain, _ = generate(scheduler(pair[0], None, str(dev), dtype), prompts, greedy)
        for name, settings in (("fixed_2x3", dict(adaptive=False, num_speculative_tokens=3, tree_branches=2)),
                               ("adaptive_3_wide", dict(tree_branches=3, tree_side_depth=1))):
            spec, _ = generate(scheduler(*pair, str(dev), dtype, **settings), prompts, greedy)
            # (bfloat16: a tree's pass runs torch's ops, which round otherwise than the fused kernels
            # of plain steps: the two may part at near-ties, as the README says; recorded, not failed)
            verdict = "equals" if dtype == "float32" else "same_as"
            report[f"tree_{name}_greedy_{verdict}_target_greedy_{dtype}"] = spec == plain
    sampled = [SamplingParams(max_new_tokens=24, temperature=0.8, top_k=k, top_p=p, seed=i, ignore_eos=True)
               for i, (k, p) in enumerate([(0, 1.0), (5, 1.0), (50, 0.9)])]
    runs = [generate(scheduler(*pair, str(dev), "float32", adaptive=False, num_speculative_tokens=3,
                               tree_branches=3), prompts, sampled)[0] for _ in range(2)]
    report["tree_seeded_sampled_batch_lengths"] = [len(t) for t in runs[0]]
    report["tree_seeded_sampled_batch_reproduces"] = runs[0] == runs[1]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = random_model(SHAPES["tiny-target" if quick else "3B"], dev, dtype)
    context, repeats = (64, 3) if quick else (512, 20)
    step = timed_pass(target, 1, 1, context, repeats, graphed=dev.type == "cuda")
    report["tree_pass_step_s"] = step
    chain5 = [-1, 0, 1, 2, 3]
    for name, parents in (("2x5", chain5 + [-1, 5, 6, 7, 8]), ("3_wide_5", chain5 + [-1, -1]),
                          ("4x5", chain5 + [p + 5 * b if p >= 0 else -1 for b in (1, 2, 3) for p in chain5])):
        tree = timed_pass(target, 1, 0, context, repeats, parents=parents)
        chain = timed_pass(target, 1, 1 + len(parents), context, repeats)
        report[f"tree_pass_{name}_nodes"] = len(parents)
        report[f"tree_pass_{name}_over_step"] = tree / step
        report[f"tree_pass_{name}_over_chain_of_as_many_tokens"] = tree / chain
    report["tree_pass_chain6_over_step"] = timed_pass(target, 1, 6, context, repeats) / step
    return report


# The policy section's systems (settings over the defaults) and rows (batch, temperature).
POLICY_SYSTEMS = {"plain": None, **{f"K={k}": dict(adaptive=False, num_speculative_tokens=k) for k in range(1, 6)},
                  "adaptive": {}, "adaptive_tree": dict(tree_branches=2, tree_side_depth=1)}
POLICY_ROWS = {"b1_greedy": (1, 0.0), "b1_T0.8": (1, 0.8), "b8_greedy": (8, 0.0), "b8_T0.8": (8, 0.8)}


def policy(dev: torch.device, tmp: Path, quick: bool) -> dict:
    """The adaptive policy on this machine, where nothing was tuned: tokens/s of plain, every fixed
    K and the adaptive engine (chains, and trees) on two pairs, each row's best fixed K beside it.
    The shipped pair (float32) is made for CPUs: on a GPU its draft step costs about what the
    target's does, so drafting loses and the policy should stay near plain. The echo pair (random
    weights of the 1B shape drafted by a 2-layer model, bfloat16; echo_checkpoint) is one whose
    drafting pays. Every system is loaded first and the systems take turns, 3 times a row, each
    row's figure the median: rows bound by the host's Python moved 2x between systems run one
    after another (docs/gpu-2026-11-30.md). Greedy output of every system is checked against plain."""
    report = {}
    tokens, repeats = (16, 1) if quick else (128, 3)
    echo_target = SHAPES["tiny-target" if quick else "1B"]
    echo_draft = dict(echo_target, hidden_size=64 if quick else 256, intermediate_size=128 if quick else 512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # (the target's vocabulary)
    pairs = {"echo": (str(echo_checkpoint(tmp / "echo-target", echo_target, dev, 1)),
                      str(echo_checkpoint(tmp / "echo-draft", echo_draft, dev, 2)), "bfloat16")}
    if (SHIPPED_TARGET / "model.safetensors").exists() and not quick:
        pairs["shipped"] = (str(SHIPPED_TARGET), str(SHIPPED_DRAFT), "float32")
    rows = {name: row for name, row in POLICY_ROWS.items() if not quick or name.startswith("b1")}
    for pair, (target, draft, dtype) in pairs.items():
        vocab = 4000 if pair == "shipped" else echo_target["vocab_size"]
        prompts = [torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(i)).tolist()
                   for i in range(2 if quick else 8)]
        scheds = {}
        for system, settings in POLICY_SYSTEMS.items():
            began = time.perf_counter()
            scheds[system] = scheduler(target, draft if settings is not None else None, str(dev), dtype,
                                       **(settings or {}))
            report[f"policy_{pair}_{system}_load_and_capture_s"] = time.perf_counter() - began
        for row, (batch, temperature) in rows.items():
            batch = min(batch, len(prompts))
            row_prompts = prompts[:max(batch, len(prompts) // 2)]  # (batch 1: 4 prompts one by one)
            params = SamplingParams(max_new_tokens=tokens, temperature=temperature, ignore_eos=True)
            warm_up = SamplingParams(max_new_tokens=16, temperature=temperature, ignore_eos=True)
            speeds, outputs = {system: [] for system in scheds}, {}
            for sched in scheds.values():
                generate(sched, prompts[:batch], [warm_up] * batch)
            for _ in range(repeats):
                for system, sched in scheds.items():
                    tok_s, outputs[system], per_round = tokens_per_second(sched, row_prompts, params, batch)
                    speeds[system].append(tok_s)
                    report[f"policy_{pair}_{row}_{system}_tokens_per_round"] = per_round
            speed = {system: sorted(runs)[len(runs) // 2] for system, runs in speeds.items()}
            best = max((s for s in scheds if not s.startswith("adaptive")), key=speed.__getitem__)
            report[f"policy_{pair}_{row}_plain_tok_s"] = speed["plain"]
            report[f"policy_{pair}_{row}_best_fixed"] = f"{best} {speed[best] / speed['plain']:.2f}x plain"
            for system in ("adaptive", "adaptive_tree"):
                report[f"policy_{pair}_{row}_{system}_over_best"] = speed[system] / speed[best]
                report[f"policy_{pair}_{row}_{system}_over_plain"] = speed[system] / speed["plain"]
            if row.endswith("greedy"):
                report[f"policy_{pair}_{row}_greedy_all_equal_plain"] = all(
                    outputs[s] == outputs["plain"] for s in scheds)
        for system, sched in scheds.items():
            for role, worker in (("target", sched.target), ("draft", getattr(sched.draft, "drafter", None))):
                runner = getattr(worker, "runner", None)
                if runner is not None and runner.graphs is not None:  # (CUDA)
                    report[f"policy_{pair}_{system}_{role}_passes_replayed"] = (
                        runner.graphs.replays / max(runner.forward_passes, 1))
        del scheds
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return report


def checks(device: str, quick: bool, out: Path, only: set[str] | None = None) -> dict:
    """Every section in turn; one that fails records its error and the rest still run. The
    report is rewritten after each section, so a run cut short keeps what it measured."""
    dev = torch.device(device)
    report: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else
                    "cpu", "quick": quick}
    os.environ[CPU_HALF_PRECISION_ENV] = "1"  # (bfloat16 through torch's ops where the device is the CPU)
    tmp = Path(tempfile.mkdtemp())
    tiny_pair(tmp)
    sections = [("smoke", lambda: smoke(dev, tmp)), ("fused_ops", lambda: fused_ops(dev)),
                ("parity", lambda: parity(dev, tmp)), ("exactness", lambda: exactness(device, tmp)),
                ("graphs", lambda: graph_replay(dev, tmp / "target")), ("families", lambda: families(dev, tmp)),
                ("timings", lambda: timings(dev, quick)), ("long_prompt", lambda: long_prompt(dev, quick)),
                ("shipped", lambda: shipped_pair(device, quick)), ("quantized", lambda: quantized(dev, tmp, quick)),
                ("trees", lambda: trees(dev, tmp, quick)), ("policy", lambda: policy(dev, tmp, quick))]
    for name, section in sections:
        if only and name not in only:
            continue
        began = time.perf_counter()
        try:
            report.update(section())
        except Exception as error:  # recorded, and the next section runs
            report[f"{name}_error"] = "".join(traceback.format_exception(error)[-6:])[-1500:]
        report[f"{name}_seconds"] = time.perf_counter() - began
        print(f"[gpu_check] {name}: {report[f'{name}_seconds']:.1f} s", flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        write_reports(report, out)
    return report


def quantized(dev: torch.device, tmp: Path, quick: bool) -> dict:
    """Weights as codes on this device (model.triton_quantized; on a CPU Triton's interpreter)."""
    from specdec.model import triton_quantized
    from specdec.model.quantized import quantize

    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return {"quantized": "not run: codes on a CPU run in the C kernels (tests/test_quantized_weights.py)"}
    report = {}
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 20)]
    greedy = [SamplingParams(max_new_tokens=32, ignore_eos=True)] * 2
    for dtype in ("float32", "bfloat16") if dev.type == "cuda" else ():  # (the CPU: tests/test_triton_quantized.py)
        for bits in ("q8", "q4"):
            formats = dict(target_weights=bits, draft_weights="q8")
            plain, _ = generate(scheduler(str(tmp / "target"), None, str(dev), dtype, **formats), prompts, greedy)
            spec, _ = generate(scheduler(str(tmp / "target"), str(tmp / "draft"), str(dev), dtype, adaptive=False,
                                         **formats), prompts, greedy)
            eager, _ = generate(scheduler(str(tmp / "target"), str(tmp / "draft"), str(dev), dtype, adaptive=False,
                                          cuda_graph_max_batch=0, **formats), prompts, greedy)
            report[f"speculative_greedy_equals_target_greedy_{bits}_{dtype}"] = spec == plain
            report[f"graphs_on_equals_graphs_off_greedy_{bits}_{dtype}"] = eager == spec
    fan_in, fan_out = (3072, 5120) if not quick else (128, 96)
    gen = torch.Generator(device=dev).manual_seed(5)
    for bits in (8, 4):  # a row's bits alone and among 8 and 40 rows (the small passes' configuration)
        codes = triton_quantized.DeviceCodes.build(quantize(torch.randn(fan_out, fan_in, device=dev, generator=gen)
                                                            * 0.02, bits), None, dev, torch.bfloat16)
        x = torch.randn(40, fan_in, device=dev, generator=gen).to(torch.bfloat16)
        alone = torch.cat([triton_quantized.quantized_product(x[i:i + 1], codes) for i in range(40)])
        report[f"q{bits}_row_alone_equals_in_8_and_40"] = (
            torch.equal(alone[:8], triton_quantized.quantized_product(x[:8], codes))
            and torch.equal(alone, triton_quantized.quantized_product(x, codes)))
    if dev.type != "cuda":
        return report
    context, repeats = (64, 3) if quick else (512, 20)
    draft_shape, target_shape = ("tiny-draft", "tiny-target") if quick else ("1B", "3B")
    for weight_format in ("fp", "q8", "q4"):
        target = random_model(SHAPES[target_shape], dev, torch.bfloat16, weight_format=weight_format)
        draft = random_model(SHAPES[draft_shape], dev, torch.bfloat16, weight_format=weight_format)
        step = timed_pass(target, 1, 1, context, repeats, graphed=True)
        draft_step = timed_pass(draft, 1, 1, context, repeats, graphed=True)
        report.update({f"{weight_format}_target_weight_bytes": target.weights.nbytes,
                       f"{weight_format}_graphed_step_s": step,
                       f"{weight_format}_graphed_step_b8_s": timed_pass(target, 8, 1, context, repeats, graphed=True),
                       f"{weight_format}_verify6_over_step": timed_pass(target, 1, 6, context, repeats, True) / step,
                       f"{weight_format}_draft_step_s": draft_step, f"{weight_format}_cost_ratio_c": draft_step / step})
        del target, draft
        torch.cuda.empty_cache()
    return report


def write_reports(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.md").write_text("| check | value |\n|---|---|\n" + "".join(
        f"| {k} | {v:.4g} |\n" if isinstance(v, float) else
        f"| {k} | {str(v).replace(chr(10), ' / ').replace('|', '/')} |\n" for k, v in report.items()))


def kv_budget(model: Model, dev: torch.device, chunk: int, block_size: int = 16) -> dict:
    """The cache the runner sizes for `model` at kv_memory_fraction 0.5, then the largest pass
    (a full chunk) at the longest context that cache allows: its peak must stay in the headroom."""
    if dev.type != "cuda":
        return {"kv_budget": "not measured: no device memory counters on the CPU "
                             "(tests/test_memory_budget.py checks the arithmetic)"}
    memory = CudaMemory(dev)
    try:
        headroom = activation_headroom(model, memory, block_size, chunk)
        blocks = accelerator_num_blocks(model, memory, block_size, 0.5, chunk, headroom=headroom)
    except MemoryError as error:
        return {"kv_budget": str(error)}
    cache = model.new_kv_cache(blocks, block_size)
    cache.add_sequence("long")
    cache.append_slots("long", max(0, min(blocks * block_size, model.config.max_position_embeddings) - chunk))
    batch = prepare_forward(cache, ["long"], [[0] * chunk], [1])
    memory.reset_peak()
    before = memory.allocated()
    model.forward(batch, cache)
    used = memory.peak() - before
    del cache, batch
    return {"kv_budget_blocks": blocks, "kv_budget_headroom_bytes": headroom,
            "kv_budget_largest_pass_bytes": used, "kv_budget_pass_within_headroom": used <= headroom}


def timings(dev: torch.device, quick: bool) -> dict:
    """Step, verify and draft costs of the reference shapes (eager and replayed from CUDA
    graphs), the memory floor, and the speedups the costs predict."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    draft_shape, target_shape = ("tiny-draft", "tiny-target") if quick else ("1B", "3B")
    target, draft = random_model(SHAPES[target_shape], dev, dtype), random_model(SHAPES[draft_shape], dev, dtype)
    context, repeats = (64, 3) if quick else (512, 20)
    weights = target.weights
    weight_bytes = sum(t.numel() * t.element_size() for t in (weights.lm_head.weight, *[
        p.weight for layer in weights.layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]))
    floor = weight_bytes / copy_bandwidth(dev, 64 if quick else 2048)  # a step reads each weight once
    report = {"shapes": [draft_shape, target_shape], "context": context, "target_weight_bytes": weight_bytes,
              "hbm_floor_step_s": floor}
    modes = ("eager", "graphed") if dev.type == "cuda" else ("eager",)
    for mode in modes:
        graphed = mode == "graphed"
        replay: dict = {}
        step = timed_pass(target, 1, 1, context, repeats, graphed, replay)
        if replay:
            report["graphed_step_replay_only_s"] = replay["s"]
        verify = timed_pass(target, 1, 6, context, repeats, graphed)
        draft_step = timed_pass(draft, 1, 1, context, repeats, graphed)
        c, verify_ratio = draft_step / step, verify / step
        report.update({f"{mode}_step_s": step, f"{mode}_step_over_floor": step / floor,
                       f"{mode}_draft_step_s": draft_step, f"{mode}_cost_ratio_c": c,
                       f"{mode}_verify6_over_step": verify_ratio,
                       f"{mode}_step_b8_s": timed_pass(target, 8, 1, context, repeats, graphed)})
        for a in (0.6, 0.8):
            report[f"{mode}_predicted_speedup_alpha_{a}_k5"] = (1 - a ** 6) / (1 - a) / (5 * c + verify_ratio)
    if dev.type == "cuda" and target.fused_ops:  # the graphed step with torch's small ops instead of fused ones
        target.fused_ops = False
        report["graphed_step_torch_ops_s"] = timed_pass(target, 1, 1, context, repeats, graphed=True)
        target.fused_ops = True
    best = modes[-1]  # what the runner uses on this device
    report.update({"step_over_floor": report[f"{best}_step_over_floor"], "cost_ratio_c": report[f"{best}_cost_ratio_c"],
                   "verify6_over_step": report[f"{best}_verify6_over_step"]})
    if dev.type == "cuda":
        report.update(kernel_profile(target, context))
    report.update(kv_budget(target, dev, 256 if quick else 2048))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and fewer tokens (CI on a CPU)")
    parser.add_argument("--out", default="gpu_check_out")
    parser.add_argument("--only", help="comma-separated sections to run (default: all)")
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    report = checks(args.device, args.quick, Path(args.out), only)
    print(json.dumps(report, indent=1))
    failed = [k for k in report if k.endswith("_error")]
    exact = [v for k, v in report.items() if "greedy_equals" in k or "all_equal" in k or k.endswith("reproduces")]
    return 0 if exact and all(exact) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
