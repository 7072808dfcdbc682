#!/usr/bin/env python
"""Every GPU claim of specdec in one run, on a bare CUDA machine (issue 24).

Needs only torch and transformers: run it from the checkout, no install, no Ray, no grpc:

    PYTHONPATH=. python scripts/gpu_check.py --out /tmp/gpu        # on a GPU (under 8 minutes)
    PYTHONPATH=. python scripts/gpu_check.py --device cpu --quick  # the same checks here (CI)

It writes <out>/gpu_check.json and <out>/gpu_check.md:
- parity: our logits against Hugging Face's, float32 and bfloat16, on a random Llama checkpoint;
- exactness: speculative greedy == the target's own greedy (float32), and a mixed sampled batch
  (top_k 0 / 5 / 50, top_p) with overlapped drafting on, run through the real scheduler;
- memory: the peak of a prompt at the context limit (chunked prefill); the KV cache the target
  shape takes at kv_memory_fraction 0.5, and whether its largest pass at the longest context then
  stays within the measured headroom;
- host syncs: .item / .tolist / .cpu / bool() per scheduler round, counted;
- timings on random-weight models of the reference pair's shapes (Llama-3.2-1B drafting for 3B,
  bfloat16; tiny shapes in --quick): a plain step against the memory floor (weight bytes / the
  measured copy bandwidth), the draft step's cost ratio c, a 6-token verify pass against a step,
  the speedup those predict at acceptance 0.6 and 0.8, and the shipped pair's measured speedup.
CUDA graphs are not captured yet: the report says so rather than pretend.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coordinator.rounds.request import Request  # noqa: E402
from coordinator.rounds.scheduler import Scheduler  # noqa: E402
from draft_worker.worker import DraftWorker  # noqa: E402
from specdec.config import SHIPPED_DRAFT, SHIPPED_TARGET, ServiceConfig  # noqa: E402
from specdec.model import load_model  # noqa: E402
from specdec.model.batch import prepare_forward  # noqa: E402
from specdec.model.config import ModelConfig  # noqa: E402
from specdec.model.decoder import CPU_HALF_PRECISION_ENV, Model  # noqa: E402
from specdec.model.memory_budget import CudaMemory, accelerator_num_blocks, activation_headroom  # noqa: E402
from specdec.model.weights import build_weights  # noqa: E402
from specdec.params import SamplingParams  # noqa: E402
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


def random_model(shape: dict, device: torch.device, dtype: torch.dtype, context: int = 4096) -> Model:
    """A model of this shape with random weights made on the device (no checkpoint on disk)."""
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
    return Model(config, build_weights(config, tensors, device, dtype, packed=False), device, dtype)


def timed_pass(model: Model, batch: int, tokens: int, context: int, repeats: int) -> float:
    """Median seconds of a pass feeding `tokens` new tokens to each of `batch` sequences of `context`."""
    device = model.device
    cache = model.new_kv_cache(num_blocks=batch * (context + tokens * (repeats + 2)) // 16 + batch * 2, block_size=16)
    ids = [str(i) for i in range(batch)]
    for s in ids:
        cache.add_sequence(s)
    model.forward(prepare_forward(cache, ids, [[1] * context] * batch, [1] * batch), cache)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        model.forward(prepare_forward(cache, ids, [[2] * tokens] * batch, [tokens] * batch), cache)
        sync(device)
        times.append(time.perf_counter() - start)
        for s in ids:
            cache.truncate_to(s, context)
    return sorted(times)[len(times) // 2]


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


def checks(device: str, quick: bool, out: Path) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # (the check's reference)

    dev = torch.device(device)
    report: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else
                    "cpu", "quick": quick}
    os.environ[CPU_HALF_PRECISION_ENV] = "1"  # (bfloat16 through torch's ops where the device is the CPU)
    tmp = Path(tempfile.mkdtemp())
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      initializer_range=0.2)).eval()
    hf.save_pretrained(tmp / "target")
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    for dtype in ("float32", "bfloat16"):
        ours = load_model(tmp / "target", device=device, dtype=dtype)
        ref = AutoModelForCausalLM.from_pretrained(tmp / "target", torch_dtype=getattr(torch, dtype)).to(dev).eval()
        with torch.no_grad():
            want = ref(ids.to(dev)).logits[0].float()
        cache = ours.new_kv_cache(num_blocks=8, block_size=16)
        cache.add_sequence("a")
        got = ours.forward(prepare_forward(cache, ["a"], [ids[0].tolist()], [64]), cache)
        report[f"parity_{dtype}_max_abs"] = float((got - want).abs().max())
    noisy = AutoModelForCausalLM.from_pretrained(tmp / "target")
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn_like(p) * 0.1 * p.std())
    noisy.save_pretrained(tmp / "draft")
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 20, 33)]
    greedy = [SamplingParams(max_new_tokens=32, ignore_eos=True)] * 3
    plain, _ = generate(scheduler(str(tmp / "target"), None, device, "float32"), prompts, greedy)
    spec, _ = generate(scheduler(str(tmp / "target"), str(tmp / "draft"), device, "float32", adaptive=False),
                       prompts, greedy)
    report["speculative_greedy_equals_target_greedy_float32"] = spec == plain
    mixed = [SamplingParams(max_new_tokens=24, temperature=0.8, top_k=k, top_p=p, seed=i, ignore_eos=True)
             for i, (k, p) in enumerate([(0, 1.0), (5, 1.0), (50, 0.9)])]
    sched = scheduler(str(tmp / "target"), str(tmp / "draft"), device, "float32", adaptive=False, overlap=True)
    with counted_host_syncs() as syncs:
        sampled, rounds = generate(sched, prompts, mixed)
    report["mixed_sampled_batch_with_overlap_lengths"] = [len(t) for t in sampled]
    report["host_syncs_per_round"] = syncs["n"] / max(rounds, 1)
    long_prompt = torch.randint(0, 512, (1000,), generator=torch.Generator().manual_seed(1)).tolist()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    runner = scheduler(str(tmp / "target"), None, device, "bfloat16", prefill_chunk_tokens=256).target.runner
    runner.cache.add_sequence("long")
    runner.run(["long"], [long_prompt], [1])
    report["long_prompt_peak_bytes"] = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    report["cuda_graphs"] = "not implemented: decode and draft steps run eagerly"
    report.update(timings(dev, quick))
    if (SHIPPED_TARGET / "model.safetensors").exists():
        shipped = [torch.randint(0, 4000, (40,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]
        runs = {}
        for name, draft in (("plain", None), ("speculative", str(SHIPPED_DRAFT))):
            sched = scheduler(str(SHIPPED_TARGET), draft, device, "float32", num_speculative_tokens=4)
            start = time.perf_counter()
            params = SamplingParams(max_new_tokens=48 if quick else 128, ignore_eos=True)
            tokens, _ = generate(sched, shipped, [params] * 4)
            runs[name] = sum(map(len, tokens)) / (time.perf_counter() - start)
        report["shipped_pair_speedup_b1_greedy"] = runs["speculative"] / runs["plain"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.md").write_text("| check | value |\n|---|---|\n" + "".join(
        f"| {k} | {v:.4g} |\n" if isinstance(v, float) else f"| {k} | {v} |\n" for k, v in report.items()))
    return report


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
    """Step, verify and draft costs of the reference shapes, the floor, and predicted speedups."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    draft_shape, target_shape = ("tiny-draft", "tiny-target") if quick else ("1B", "3B")
    target, draft = random_model(SHAPES[target_shape], dev, dtype), random_model(SHAPES[draft_shape], dev, dtype)
    context, repeats = (64, 3) if quick else (512, 10)
    step, verify = timed_pass(target, 1, 1, context, repeats), timed_pass(target, 1, 6, context, repeats)
    draft_step = timed_pass(draft, 1, 1, context, repeats)
    weight_bytes = sum(t.numel() * t.element_size() for t in (target.weights.embed, *[
        p.weight for layer in target.weights.layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]))
    floor = weight_bytes / copy_bandwidth(dev, 64 if quick else 1024)  # a step reads each weight once
    c, verify_ratio = draft_step / step, verify / step
    predicted = {f"predicted_speedup_alpha_{a}_k5": (1 - a ** 6) / (1 - a) / (5 * c + verify_ratio) for a in (0.6, 0.8)}
    return {"shapes": [draft_shape, target_shape], "plain_step_s": step, "step_over_floor": step / floor,
            "draft_step_s": draft_step, "cost_ratio_c": c, "verify6_over_step": verify_ratio, **predicted,
            **kv_budget(target, dev, 256 if quick else 2048)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and fewer tokens (CI on a CPU)")
    parser.add_argument("--out", default="gpu_check_out")
    args = parser.parse_args(argv)
    report = checks(args.device, args.quick, Path(args.out))
    print(json.dumps(report, indent=1))
    return 0 if report["speculative_greedy_equals_target_greedy_float32"] else 1


if __name__ == "__main__":
    sys.exit(main())
