import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Measured round costs are cached per checkpoint; keep the tests' in a directory of their own.
os.environ.setdefault("SPECDEC_CACHE_DIR", tempfile.mkdtemp(prefix="specdec-test-cache-"))
# Without a GPU, Triton's kernels (the GPU path: specdec.model.triton_attention, triton_ops) run in
# its CPU interpreter; it must be chosen before Triton compiles anything.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Two cores: one intra-op thread per test process keeps timings stable and avoids oversubscription.
torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "1")))

from checkpoints import CONFIGS, FAMILY_CONFIGS, build_checkpoint, perturbed_copy  # noqa: E402
from gates import PACE, PACES  # noqa: E402

# SPECDEC_TEST_PACE=slow|fast proves that no test depends on how fast this machine is (a test must
# hold the service in the state it checks, with tests/gates.py, rather than hope to catch it):
# - slow: every model forward pass (ModelRunner.run) and every n-gram proposal sleeps SLOW_PASS_S
#   more; a pass of the tests' tiny models takes ~0.5 ms here, so the service runs 3-7x slower.
# - fast: the tests look later instead: on the main thread a test file's own time.sleep lasts
#   FAST_LOOK_FACTOR times longer, a streamed gRPC response reaches it late (the first, after which
#   a test usually acts on a running request, FAST_FIRST_READ_S; the others FAST_READ_S), and
#   gates.wait_until polls every 0.2 s, first after a pause: ~10x faster relative to the test.
#   The autoscaler's clock (coordinator.replicas.router) runs FAST_LOOK_FACTOR times slower too, so rounds
#   are ~10x faster relative to its scale-up window and idle time as well.
# It paces this process only: Ray actors and other subprocesses run at the machine's own pace.
# tests/test_pace.py runs a few gated tests under both paces.
SLOW_PASS_S = 0.003
FAST_LOOK_FACTOR = 10
FAST_FIRST_READ_S = 0.5
FAST_READ_S = 0.01
TESTS_DIR = str(Path(__file__).resolve().parent)
if PACE not in PACES:
    raise pytest.UsageError(f"SPECDEC_TEST_PACE={PACE!r}: expected one of {', '.join(PACES)}")


def _slowed(method):
    def slowed(*args, **kwargs):
        time.sleep(SLOW_PASS_S)
        return method(*args, **kwargs)
    return slowed


class _SlowClock:
    """The time module, but time.monotonic() advances FAST_LOOK_FACTOR times slower."""

    def __init__(self):
        self._start = time.monotonic()

    def monotonic(self) -> float:
        return self._start + (time.monotonic() - self._start) / FAST_LOOK_FACTOR

    def __getattr__(self, name):
        return getattr(time, name)


class _LateReader:
    """A streaming call whose responses reach the main thread late."""

    def __init__(self, call):
        self._call = call
        self._delay_s = FAST_FIRST_READ_S

    def __iter__(self):
        return self

    def __next__(self):
        response = next(self._call)
        if threading.current_thread() is threading.main_thread():
            time.sleep(self._delay_s)
            self._delay_s = FAST_READ_S
        return response

    def __getattr__(self, name):
        return getattr(self._call, name)


@pytest.fixture(scope="session", autouse=True)
def pace():
    """Installs SPECDEC_TEST_PACE's slowdowns for the whole session (module fixtures included)."""
    with pytest.MonkeyPatch.context() as patch:
        if PACE == "slow":
            from draft_worker.ngram_drafter import NgramDrafter
            from specdec.model.runner import ModelRunner

            patch.setattr(ModelRunner, "run", _slowed(ModelRunner.run))
            patch.setattr(NgramDrafter, "propose", _slowed(NgramDrafter.propose))
        elif PACE == "fast":
            import coordinator.replicas.router
            from specdec.client import GenerationClient

            real_sleep, real_stream = time.sleep, GenerationClient.generate_stream

            def late_sleep(seconds):
                caller = sys._getframe(1).f_code.co_filename
                if (threading.current_thread() is threading.main_thread() and caller.startswith(TESTS_DIR)
                        and os.path.basename(caller).startswith("test_")):
                    seconds *= FAST_LOOK_FACTOR
                real_sleep(seconds)

            patch.setattr(time, "sleep", late_sleep)
            patch.setattr(coordinator.replicas.router, "time", _SlowClock())
            patch.setattr(GenerationClient, "generate_stream",
                          lambda self, *args, **kwargs: _LateReader(real_stream(self, *args, **kwargs)))
        yield PACE


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def target_dir(request, tmp_path_factory) -> Path:
    """A random target checkpoint for each config shape."""
    return build_checkpoint(tmp_path_factory.mktemp(f"target-{request.param}"), seed=0, **CONFIGS[request.param])


@pytest.fixture(scope="session")
def gqa_target_dir(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("gqa-target"), seed=0, **CONFIGS["gqa_untied"])


@pytest.fixture(scope="session")
def quantization_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A small target and a noisy copy as its draft: the weight formats' tests (CPU and GPU)."""
    shape = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    target = build_checkpoint(tmp_path_factory.mktemp("q-target"), seed=4, **shape)
    return target, perturbed_copy(target, tmp_path_factory.mktemp("q-draft"), noise=0.3)


@pytest.fixture(scope="session", params=sorted(FAMILY_CONFIGS))
def family_dir(request, tmp_path_factory) -> Path:
    """A random target checkpoint of each family other than Llama (Mistral, Qwen2, Qwen3 shapes)."""
    return build_checkpoint(tmp_path_factory.mktemp(f"family-{request.param}"), seed=0,
                            **FAMILY_CONFIGS[request.param])
