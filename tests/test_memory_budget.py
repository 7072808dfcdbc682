"""The KV cache's size on an accelerator (specdec.model.memory_budget), run on the CPU: the model
is the real one, the device's memory counters a fake that the test scripts, so the arithmetic and
the probe passes are checked without a GPU (scripts/gpu_check.py measures the real counters)."""
from __future__ import annotations

import pytest
import torch

from specdec.config import TargetConfig, WorkerConfig
from specdec.model.decoder import load_model
from specdec.model.memory_budget import bytes_per_block
from specdec.model.runner import ModelRunner

from checkpoints import CONFIGS, build_checkpoint

BLOCK = 4
CHUNK = 32


class Recorded:
    """The real model, recording the (new tokens, context) of each pass it runs; `on_cuda`: it
    reports itself on cuda:0, so the runner sizes its cache from device memory."""

    def __init__(self, model, on_cuda: bool = True):
        self._model = model
        self.passes: list[tuple[int, int]] = []
        self.device = torch.device("cuda", 0) if on_cuda else model.device

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, batch, cache):
        self.passes.append((batch.num_tokens, batch.context_len))
        return self._model.forward(batch, cache)


class ScriptedMemory:
    """Device counters: `total` and `free` bytes; each probe pass peaks at the next of `peaks`
    bytes above what was allocated when its peak was reset."""

    def __init__(self, total: int, free: int, peaks: list[int]):
        self.total, self.free, self.peaks = total, free, list(peaks)
        self.resets = 0

    def free_and_total(self):
        return self.free, self.total

    def reset_peak(self):
        self.resets += 1

    def allocated(self):
        return 1000

    def peak(self):
        return 1000 + self.peaks.pop(0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("budget"), seed=0, max_position_embeddings=256,
                            **CONFIGS["gqa_untied"])
    return load_model(path)


def _config(**kwargs) -> WorkerConfig:
    return TargetConfig(kv_block_size=BLOCK, prefill_chunk_tokens=CHUNK, **kwargs)


def test_a_worker_takes_its_share_less_its_weights_and_the_measured_headroom(model):
    block = bytes_per_block(model, BLOCK)
    weights = model.num_parameters * 4
    # The chunk peaks at 100 blocks' worth at context 0 and 110 after one chunk: +10 per chunk of
    # context, so 256 positions (224 beyond the first chunk, 7 chunks) need 100 + 70 blocks' worth.
    memory = ScriptedMemory(total=10 * weights + 4000 * block, free=10 * weights + 4000 * block,
                            peaks=[100 * block, 110 * block])
    on_cuda = Recorded(model)
    runner = ModelRunner(on_cuda, _config(kv_memory_fraction=0.5), memory)
    expected = (int(0.5 * memory.total) - weights - 170 * block) // block
    assert runner.cache.allocator.num_blocks == expected
    # Two probe passes of a full chunk, at context 0 and after one chunk; nothing left behind.
    assert on_cuda.passes == [(CHUNK, CHUNK), (CHUNK, 2 * CHUNK)] and memory.resets == 2
    assert runner.cache.sequence_ids() == [] and runner.cache.allocator.num_used == 0


def test_a_worker_sharing_the_gpu_takes_no_more_than_is_free(model):
    """The first worker on a GPU must not take the second's share: each keeps to its fraction of
    the total, and neither takes more than is free less its headroom."""
    block = bytes_per_block(model, BLOCK)
    memory = ScriptedMemory(total=100_000 * block, free=300 * block, peaks=[50 * block, 50 * block])
    runner = ModelRunner(Recorded(model), _config(kv_memory_fraction=0.9), memory)
    assert runner.cache.allocator.num_blocks == 250


def test_no_room_for_a_cache_is_an_error_naming_the_setting(model):
    block = bytes_per_block(model, BLOCK)
    memory = ScriptedMemory(total=100_000 * block, free=40 * block, peaks=[50 * block, 50 * block])
    with pytest.raises(MemoryError, match=r"target\.kv_memory_fraction=0\.9 .* prefill_chunk_tokens=32"):
        ModelRunner(Recorded(model), _config(kv_memory_fraction=0.9), memory)


def test_an_explicit_size_wins_and_measures_nothing(model):
    memory = ScriptedMemory(total=0, free=0, peaks=[])
    on_cuda = Recorded(model)
    assert ModelRunner(on_cuda, _config(kv_cache_blocks=7), memory).cache.allocator.num_blocks == 7
    assert on_cuda.passes == [] and memory.resets == 0


def test_passes_never_take_more_than_the_chunk_in_all(model):
    """The probe's chunk must be the largest pass: several prompts at once are fed in passes of at
    most prefill_chunk_tokens tokens together, each prompt in order."""
    on_cpu = Recorded(model, on_cuda=False)
    runner = ModelRunner(on_cpu, _config(kv_cache_blocks=64))
    prompts = [list(range(1, 1 + n)) for n in (20, 30, 5)]
    for seq in "abc":
        runner.cache.add_sequence(seq)
    logits = runner.run(list("abc"), prompts, [1, 2, 5])
    assert [t.shape[0] for t in logits] == [1, 2, 5]
    assert [tokens for tokens, _ in on_cpu.passes] == [32, 23]
    assert [runner.cache.length(s) for s in "abc"] == [20, 30, 5]


def test_a_headroom_measured_already_is_not_measured_again(model):
    from specdec.model.memory_budget import accelerator_num_blocks

    block = bytes_per_block(model, BLOCK)
    memory = ScriptedMemory(total=100_000 * block, free=300 * block, peaks=[])
    recorded = Recorded(model)
    assert accelerator_num_blocks(recorded, memory, BLOCK, 0.9, CHUNK, headroom=50 * block) == 250
    assert recorded.passes == [] and memory.resets == 0


def test_the_cuda_graphs_logits_are_kept_out_of_the_cache(model):
    """Every graph writes its logits into one buffer of the largest bucket's 16 rows (a 128k
    vocabulary at 32 sequences: 263 MB), which the cache's budget leaves free (the runner twice
    that: the graphs' pool holds the largest pass's own logits too)."""
    from specdec.model.cuda_graphs import graph_logits_bytes
    from specdec.model.memory_budget import accelerator_num_blocks

    assert graph_logits_bytes(128256, 32) == 32 * 16 * 128256 * 4 and graph_logits_bytes(100, 3) == 4 * 16 * 100 * 4
    block = bytes_per_block(model, BLOCK)
    memory = ScriptedMemory(total=100_000 * block, free=300 * block, peaks=[])
    assert accelerator_num_blocks(Recorded(model), memory, BLOCK, 0.9, CHUNK, headroom=50 * block,
                                  reserved=20 * block) == 230
