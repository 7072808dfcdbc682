"""Replicas and autoscaling in k8s/: in-tree autoscaling on, worker groups whose minReplicas /
replicas / maxReplicas are the head's SPECDEC_MIN_REPLICAS / SPECDEC_REPLICAS / SPECDEC_MAX_REPLICAS
(in the base, every overlay and the README's examples), no draft pods with the n-gram drafter, and
Ray's autoscaler reading the groups as specdec's actors need them.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import textwrap

import pytest
import yaml

from k8s_base import base_groups, base_raycluster, replica_bounds, script_of
from k8s_render import K8S, VARIANTS, env_values, groups, kubectl, one, ray_container, rendered

# --- replicas and autoscaling ------------------------------------------------------------------


def _check_replica_bounds(cluster: dict) -> None:
    """The worker groups' replicas / minReplicas / maxReplicas are what `specdec serve` will ask
    for, given the head's replica settings."""
    by_name = groups(cluster)
    env = env_values(ray_container(by_name["head"]))
    lowest, start, highest = (int(env[f"SPECDEC_{x}REPLICAS"]) for x in ("MIN_", "", "MAX_"))
    assert 1 <= lowest <= start <= highest
    # One target pod per target replica: KubeRay's bounds are specdec's.
    assert replica_bounds(by_name["target"]) == (lowest, start, highest)
    if env["SPECDEC_DRAFT"] in ("ngram", "none"):
        assert replica_bounds(by_name["draft"]) == (0, 0, 0)  # no draft worker at all
    elif env.get("SPECDEC_DRAFT_REPLICAS"):
        shared = int(env["SPECDEC_DRAFT_REPLICAS"])
        assert replica_bounds(by_name["draft"]) == (shared, shared, shared)
    else:  # one draft worker per target replica
        assert replica_bounds(by_name["draft"]) == (lowest, start, highest)


@pytest.mark.parametrize("variant", VARIANTS)
def test_worker_group_bounds_match_the_heads_replica_settings(variant):
    _check_replica_bounds(one(rendered(variant), "RayCluster"))


def _readme_kustomizations() -> list[dict]:
    """The kustomization examples in k8s/README.md (YAML blocks with patches or resources)."""
    text = (K8S / "README.md").read_text()
    blocks = [yaml.safe_load(textwrap.dedent(b)) for b in re.findall(r"^ *```yaml\n(.*?)^ *```", text, re.M | re.S)]
    return [b for b in blocks if isinstance(b, dict) and ("patches" in b or "resources" in b)]


def test_readme_kustomization_examples_build_and_keep_the_bounds_consistent(tmp_path):
    """What k8s/README.md tells operators to write builds against the base (its `test` operations
    pass, so the indices it patches are right) and leaves the replica bounds consistent."""
    examples = _readme_kustomizations()
    assert len(examples) >= 4, "the models, scale, overlay and TLS examples"
    shutil.copytree(K8S, tmp_path / "k8s")
    overlay = tmp_path / "my-cluster"
    overlay.mkdir()
    scaled = []
    for example in examples:
        example = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                   "resources": ["../k8s/base"], **example}
        (overlay / "kustomization.yaml").write_text(yaml.safe_dump(example))
        result = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{example}\n{result.stderr}"
        cluster = one([d for d in yaml.safe_load_all(result.stdout) if d], "RayCluster")
        _check_replica_bounds(cluster)
        scaled.append(replica_bounds(groups(cluster)["target"]))
    assert (2, 2, 8) in scaled, "the scale example sets 2..8 replicas"


def test_in_tree_autoscaling_is_on_and_keeps_idle_gpu_pods_a_while():
    spec = base_raycluster()["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    options = spec["autoscalerOptions"]
    assert options["upscalingMode"] in ("Default", "Aggressive", "Conservative")
    # Longer than it takes to start a GPU pod and load a model again, so that load coming back a
    # minute later does not pay for that.
    assert options["idleTimeoutSeconds"] >= 120
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(options["resources"][kind])
    assert options["securityContext"]["allowPrivilegeEscalation"] is False


# What each specdec actor asks Ray for (specdec_app/ray_cluster.py): the coordinator on the head,
# one target / draft worker per GPU pod of its group.
ACTOR_DEMANDS = {"headgroup": {"specdec_coordinator": 1}, "target": {"GPU": 1, "specdec_target": 1},
                 "draft": {"GPU": 1, "specdec_draft": 1}}


@pytest.mark.parametrize("variant", VARIANTS)
def test_rays_autoscaler_reads_the_groups_as_specdec_needs_them(variant):
    """Ray's own translation of the RayCluster into its autoscaler's node types (what the KubeRay
    autoscaler sidecar runs): each actor's demand fits exactly one node type, and the bounds are
    the head's replica settings."""
    kuberay = pytest.importorskip("ray.autoscaler._private.kuberay.autoscaling_config")
    cluster = one(rendered(variant), "RayCluster")
    config = kuberay._derive_autoscaling_config_from_ray_cr(cluster)
    node_types = config["available_node_types"]
    assert set(node_types) == set(ACTOR_DEMANDS)
    for actor, demand in ACTOR_DEMANDS.items():
        fits = [name for name, node in node_types.items()
                if all(node["resources"].get(k, 0) >= v for k, v in demand.items())]
        assert fits == [actor], (actor, fits)
    by_name = groups(cluster)
    for name in ("target", "draft"):
        assert (node_types[name]["min_workers"], node_types[name]["max_workers"]) == \
            (by_name[name]["minReplicas"], by_name[name]["maxReplicas"])
    assert config["idle_timeout_minutes"] * 60 == cluster["spec"]["autoscalerOptions"]["idleTimeoutSeconds"]


def test_replica_settings_reach_specdec_serve_through_its_environment():
    env = env_values(ray_container(base_groups()["head"]))
    assert env["SPECDEC_DRAFT_PLACEMENT"] in ("colocated", "spread")
    assert 0 < float(env["SPECDEC_KV_MEMORY_FRACTION"]) <= 1
    script = script_of(ray_container(base_groups()["head"]))
    # `specdec serve` reads SPECDEC_* itself; a flag on the command line would override the env.
    for flag in ("--replicas", "--min-replicas", "--max-replicas", "--draft-placement"):
        assert flag not in script
