"""The GPU path, checked without a GPU: every tensor on the decoding path is made on the device of
the data it meets. A lint over the device-path modules finds tensor constructors without a device;
the model's forward and the drafter's sampling run on the `meta` device, where any op that mixes
a meta tensor with a CPU one raises (as CUDA with CPU would); uniforms made on a device are the
CPU's bits."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from draft_worker.model_drafter import choose_tokens
from specdec.model import load_model
from specdec.model.batch import prepare_forward
from specdec.params import SamplingParams
from specdec.sampling import random as random_module
from target_worker.worker import pad_rows, padded_proposals

from checkpoints import CONFIGS, build_checkpoint

ROOT = Path(__file__).resolve().parents[1]
# Modules whose tensors meet the model's: every constructor names its device, or says on its line
# why it is a host tensor ("# host:").
DEVICE_PATH = ["draft_worker/model_drafter.py", "target_worker/worker.py", "target_worker/proposal_check.py",
               "target_worker/sampled_chains.py",
               "coordinator/rounds/predraft.py", "specdec/sampling/speculative.py", "specdec/sampling/transforms.py",
               "specdec/model/attention.py", "specdec/model/batch.py", "specdec/model/decoder.py",
               "specdec/kv_cache.py", "specdec/model/triton_attention.py", "specdec/model/triton_ops.py",
               "specdec/model/gpu_forward.py", "specdec/model/cuda_graphs.py"]
CONSTRUCTORS = {"tensor", "zeros", "ones", "full", "empty", "arange", "randn", "rand", "randint", "as_tensor"}


def constructors_without_device(path: Path) -> list[str]:
    """"line: code" of each torch constructor in `path` without device= and without "# host:"."""
    source = path.read_text()
    lines = source.splitlines()
    return [f"{node.lineno}: {lines[node.lineno - 1].strip()}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CONSTRUCTORS
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
            and not any(k.arg == "device" for k in node.keywords) and "# host:" not in lines[node.lineno - 1]]


def test_device_path_modules_make_every_tensor_on_a_named_device():
    found = [f"{name}:{line}" for name in DEVICE_PATH for line in constructors_without_device(ROOT / name)]
    assert not found, "\n".join(found)


def test_the_lint_finds_a_constructor_without_a_device(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nx = torch.tensor([1, 2])\ny = torch.zeros(3, device=x.device)\n"
                   "z = torch.ones(2)  # host: a count read on the CPU\n")
    assert constructors_without_device(bad) == ["2: x = torch.tensor([1, 2])"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("meta"), seed=0, **CONFIGS["gqa_untied"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_models_forward_runs_on_the_meta_device(model_dir, dtype):
    """Prefill, a ragged verify-shaped pass and a decode step, every tensor on one device."""
    model = load_model(model_dir, device="meta", dtype=dtype, cpu_kernels=False)
    cache = model.new_kv_cache(num_blocks=16, block_size=8)
    for seq in "ab":
        cache.add_sequence(seq)
    out = model.forward(prepare_forward(cache, ["a", "b"], [[1, 2, 3, 4], [5, 6]], [4, 1]), cache)
    assert out.device.type == "meta" and out.shape == (5, 300)
    out = model.forward(prepare_forward(cache, ["a", "b"], [[7, 8, 9], [1]], [3, 1]), cache)
    assert out.device.type == "meta" and out.shape == (4, 300)


def test_draft_sampling_with_rows_of_different_widths_stays_on_the_device(monkeypatch):
    """top_k=5 beside top_k=0 (different q widths), top_p, greedy: one device throughout. (The
    inverse-CDF repair check reads one flag from the device; meta tensors have no values.)"""
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: False if self.device.type == "meta" else
                        bool(self.item()))
    logits = torch.empty(4, 300, device="meta")
    params = [SamplingParams(temperature=0.8, top_k=5, seed=1), SamplingParams(temperature=0.8, seed=2),
              SamplingParams(), SamplingParams(temperature=0.8, top_k=50, seed=3)]
    tokens, q = choose_tokens(logits, params, [[1, 2]] * 4, max_q_entries=64)
    assert tokens.device.type == "meta" and all(ids.device.type == "meta" for ids, _ in q.values())
    params[1] = SamplingParams(temperature=0.8, top_p=0.9, seed=2)
    tokens, q = choose_tokens(logits, params, [[1, 2]] * 4, max_q_entries=64)
    assert tokens.device.type == "meta"


def test_the_targets_proposal_tensors_are_made_on_the_logits_device():
    from specdec.round_types import SparseDist, VerifyTask

    q = SparseDist(token_ids=torch.tensor([[3, 4], [5, 6]]), probs=torch.tensor([[0.5, 0.5], [0.25, 0.75]]))
    tasks = [VerifyTask("a", [], [3, 6], q, SamplingParams(temperature=1.0, seed=1)),
             VerifyTask("b", [], [], None, SamplingParams())]
    ids, probs = padded_proposals(tasks, 2, torch.device("meta"))
    assert ids.device.type == probs.device.type == "meta" and ids.shape == (2, 2, 2)
    assert pad_rows([[1, 2], [3]], 2, torch.device("meta")).device.type == "meta"


def test_uniforms_made_on_a_device_are_the_cpus_bits():
    seeds = [0, 1, 2**63, 2**64 - 1, 123456789]
    positions = np.random.default_rng(0).integers(0, 10**9, (5, 6))
    for purpose in (random_module.DRAFT, random_module.ACCEPT, random_module.TARGET):
        cpu = random_module.uniforms(seeds, positions, purpose)
        keys = random_module.mix64(np.asarray(seeds, dtype=np.uint64) ^ random_module._SALT[purpose]).reshape(5, 1)
        torch_made = random_module._device_uniforms(keys, positions, torch.device("cpu"))
        assert torch.equal(cpu, torch_made)
    on_meta = random_module.uniforms(seeds, positions, random_module.ACCEPT, device="meta")
    assert on_meta.device.type == "meta" and on_meta.shape == (5, 6) and on_meta.dtype == torch.float64


# On a GPU every read of a tensor's values (.item, .tolist, .cpu, bool) waits for the device. A
# round reads per draft step its tokens and, sampled on the CPU, the sampler's repair flag (off the
# CPU the sampler reads none: test_speculative_math); then a few for the verify (the proposal
# checks' flags, the accepted counts and tokens). Measured on this CPU at K = 4, batch 1 / 8:
# greedy 4.5 / 4.2, sampled 11.3 / 10.9 per round; with the proposal checked task by task
# (before), sampled read 14.9 / 37.3.
K = 4
SYNCS_PER_DRAFT_STEP = 2
SYNCS_PER_VERIFY = 6


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_host_syncs_per_round_are_a_constant_whatever_the_batch(model_dir, tmp_path, temperature, monkeypatch):
    import sys

    import specdec.sampling.random as random_module
    import specdec.sampling.speculative as speculative

    # Small batches on the CPU draw, verify and hash their uniforms a row at a time in Python (reads
    # a GPU never makes: those paths are the CPU's); off here, so the count is the device path's.
    monkeypatch.setattr(speculative, "_ROW_AT_A_TIME", 0)
    monkeypatch.setattr(random_module, "_FEW", 0)
    sys.path.insert(0, str(ROOT / "scripts"))  # the device check's counting hook (scripts/ is no package)
    from gpu_check import counted_host_syncs, generate, scheduler

    from checkpoints import perturbed_copy

    draft_dir = perturbed_copy(model_dir, tmp_path / "draft", noise=0.1)
    per_round = {}
    for batch in (1, 8):
        prompts = [list(range(3 + i, 12 + 2 * i)) for i in range(batch)]
        params = [SamplingParams(max_new_tokens=16, temperature=temperature, top_k=(0, 5, 50)[i % 3] if temperature
                                 else 0, seed=i, ignore_eos=True) for i in range(batch)]
        sched = scheduler(str(model_dir), str(draft_dir), "cpu", "float32", adaptive=False,
                          num_speculative_tokens=K)
        with counted_host_syncs() as syncs:
            _, rounds = generate(sched, prompts, params)
        per_round[batch] = syncs["n"] / rounds
    assert max(per_round.values()) <= K * SYNCS_PER_DRAFT_STEP + SYNCS_PER_VERIFY, per_round
