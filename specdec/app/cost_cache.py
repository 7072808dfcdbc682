"""Round costs measured once per model pair, device and transport, kept on disk.

The adaptive policy needs what rounds cost on this machine (coordinator.round_costs); measuring
takes a few seconds, so the result is stored under $SPECDEC_CACHE_DIR (default ~/.cache/specdec)
keyed by everything that changes it: both models (resolved path, and the size and time of every file
they are read from: a checkpoint directory's, a .gguf file, a Hub snapshot's), device, dtype,
threads, packed weights, the batch and K limits, the runtime's revision, in process or over gRPC,
torch and the CPU. The scheduler keeps correcting the figures from every round it runs, so a stale entry only starts
the policy off a little wrong.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from pathlib import Path

import torch

from coordinator.round_costs import RoundCosts
from specdec.config import NGRAM, ServiceConfig, cache_dir
from specdec.model.source import resolve_model_source

log = logging.getLogger(__name__)


def _checkpoint_fingerprint(spec: str | None) -> list:
    """What identifies a model spec's weights here; the spec alone for "ngram", none, or a spec
    that names no model (loading it fails on its own, with the resolver's message)."""
    if spec is None or spec == NGRAM:
        return [spec]
    try:
        return resolve_model_source(spec).fingerprint()
    except (ValueError, OSError):
        return [spec]


# Bump when a change to the model runtime changes what steps cost (e.g. the packed projections):
# entries measured with the old code must not seed the policy of the new.
RUNTIME_REVISION = 11


def cost_cache_path(config: ServiceConfig, transport: str) -> Path:
    key = json.dumps([
        RUNTIME_REVISION,
        _checkpoint_fingerprint(config.target.model), _checkpoint_fingerprint(config.draft.model),
        [config.target.device, config.target.resolved_dtype, config.target.num_threads, config.target.packed_weights,
         config.target.cpu_kernels],
        [config.draft.device, config.draft.resolved_dtype, config.draft.num_threads, config.draft.packed_weights,
         config.draft.cpu_kernels],
        [config.scheduler.max_batch_size, config.scheduler.num_speculative_tokens, transport],
        [torch.__version__, torch.get_num_threads(), os.cpu_count(), platform.machine(), platform.processor()],
    ], default=str)
    return cache_dir() / f"round-costs-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def load_costs(config: ServiceConfig, transport: str) -> RoundCosts | None:
    path = cost_cache_path(config, transport)
    try:
        return RoundCosts.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def save_costs(config: ServiceConfig, transport: str, costs: RoundCosts) -> None:
    path = cost_cache_path(config, transport)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(costs.to_json()))
        tmp.replace(path)
    except OSError as e:  # a read-only home must not stop the service
        log.warning("could not cache round costs in %s: %s", path, e)
