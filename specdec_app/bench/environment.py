"""Where a bench ran: the machine (CPU, load average), the versions (Python, torch, transformers,
the git commit) and the models' sizes, recorded beside the figures in bench.json.
"""
from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from specdec.config import REPO_ROOT


def load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def format_load(load: list[float] | None) -> str:
    return "unknown" if load is None else " ".join(f"{x:.2f}" for x in load)


def environment(args, param_counts: dict, load_at_start: list[float] | None) -> dict:
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = None
    try:
        commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
    except Exception:
        pass
    return {
        "python": platform.python_version(), "platform": platform.platform(), "cpu": cpu,
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": metadata.version("transformers"),
        "torch_threads": torch.get_num_threads(), "git_commit": commit,
        "load_average_at_start": load_at_start,
        "parameters": param_counts,
    }
