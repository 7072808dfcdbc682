"""The k8s/ manifests as `kubectl kustomize` renders them: the base and every overlay.

kubectl (which has kustomize built in) runs offline here; without it the tests that need a
rendering are skipped, not passed.
"""
from __future__ import annotations

import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
BASE = "base"
OVERLAYS = tuple(sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml")))
VARIANTS = (BASE, *(f"overlays/{name}" for name in OVERLAYS))


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    return path


@cache
def _rendered_text(variant: str) -> str:
    result = subprocess.run([kubectl(), "kustomize", str(K8S / variant)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, f"kubectl kustomize k8s/{variant} failed:\n{result.stderr}"
    return result.stdout


def rendered(variant: str = BASE) -> list[dict]:
    """The objects `kubectl kustomize k8s/<variant>` prints; a fresh copy, free to modify."""
    return [d for d in yaml.safe_load_all(_rendered_text(variant)) if d]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected exactly one {kind} {name or ''}, found {len(found)}"
    return found[0]


def groups(cluster: dict) -> dict[str, dict]:
    """'head' -> headGroupSpec, then groupName -> workerGroupSpec."""
    spec = cluster["spec"]
    return {"head": spec["headGroupSpec"], **{g["groupName"]: g for g in spec["workerGroupSpecs"]}}


def ray_container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]  # KubeRay's Ray container is containers[0]


def env_values(container: dict) -> dict[str, str]:
    """The container's literal env values (not the ones from Secrets)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
