import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Measured round costs are cached per checkpoint; keep the tests' in a directory of their own.
os.environ.setdefault("SPECDEC_CACHE_DIR", tempfile.mkdtemp(prefix="specdec-test-cache-"))
# Two cores: one intra-op thread per test process keeps timings stable and avoids oversubscription.
torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "1")))

from checkpoints import CONFIGS, FAMILY_CONFIGS, build_checkpoint  # noqa: E402


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def target_dir(request, tmp_path_factory) -> Path:
    """A random target checkpoint for each config shape."""
    return build_checkpoint(tmp_path_factory.mktemp(f"target-{request.param}"), seed=0, **CONFIGS[request.param])


@pytest.fixture(scope="session")
def gqa_target_dir(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("gqa-target"), seed=0, **CONFIGS["gqa_untied"])


@pytest.fixture(scope="session", params=sorted(FAMILY_CONFIGS))
def family_dir(request, tmp_path_factory) -> Path:
    """A random target checkpoint of each family other than Llama (Mistral, Qwen2, Qwen3 shapes)."""
    return build_checkpoint(tmp_path_factory.mktemp(f"family-{request.param}"), seed=0,
                            **FAMILY_CONFIGS[request.param])
