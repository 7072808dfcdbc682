"""The overlays of k8s/: each changes only what it is for, everything lands in the specdec
namespace, the GPU overlays pin the worker groups, n-gram drafting has no draft pods, and a next
cluster serves beside the first behind the same Service and policies.
"""
from __future__ import annotations

import pytest

from k8s_base import (
    MISSING,
    allowed,
    base_groups,
    base_one,
    base_raycluster,
    changed_paths,
    pod_labels,
    replica_bounds,
    selector_matches,
    worker_port,
)
from k8s_render import BASE, OVERLAYS, VARIANTS, env_values, groups, one, ray_container, rendered

# --- overlays ----------------------------------------------------------------------------------

def _by_key(docs: list[dict]) -> dict[str, dict]:
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


WORKER_NODE_SELECTORS = {"/spec/workerGroupSpecs/0/template/spec/nodeSelector",
                         "/spec/workerGroupSpecs/1/template/spec/nodeSelector"}
OVERLAY_CHANGES = {
    "storage-class": {"PersistentVolumeClaim/specdec-models": {"/spec/storageClassName"}},
    "gpu-operator": {"RayCluster/specdec": WORKER_NODE_SELECTORS},
    "gpu-node-label": {"RayCluster/specdec": WORKER_NODE_SELECTORS},
    "ngram": {"RayCluster/specdec": {"/spec/headGroupSpec/template/spec/containers/0/env/1/value",
                                     "/spec/headGroupSpec/template/spec/initContainers/0/env/1/value",
                                     "/spec/workerGroupSpecs/1/replicas", "/spec/workerGroupSpecs/1/minReplicas",
                                     "/spec/workerGroupSpecs/1/maxReplicas"}},
    "podmonitor": {"PodMonitor/specdec": {""}, "NetworkPolicy/specdec-metrics": {""}},  # "": added
    "next-cluster": {"RayCluster/specdec": {""}, "RayCluster/specdec-next": {""}},  # renamed
}


def test_every_overlay_is_covered_here():
    assert set(OVERLAYS) == set(OVERLAY_CHANGES)


@pytest.mark.parametrize("overlay", sorted(OVERLAY_CHANGES))
def test_each_overlay_changes_only_what_it_is_for(overlay):
    base, changed = _by_key(rendered(BASE)), _by_key(rendered(f"overlays/{overlay}"))
    diff = {key: paths for key in base.keys() | changed.keys()
            if (paths := changed_paths(base.get(key, MISSING), changed.get(key, MISSING)))}
    assert diff == OVERLAY_CHANGES[overlay]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_rendered_object_lands_in_the_specdec_namespace(variant):
    for doc in rendered(variant):
        assert doc["metadata"].get("namespace") == "specdec", (variant, doc["kind"], doc["metadata"]["name"])


def test_gpu_overlays_pin_both_worker_groups_and_never_the_head():
    for overlay, selector in [("gpu-operator", {"nvidia.com/gpu.present": "true"}),
                              ("gpu-node-label", None)]:
        by_name = groups(one(rendered(f"overlays/{overlay}"), "RayCluster"))
        chosen = {name: by_name[name]["template"]["spec"].get("nodeSelector") for name in by_name}
        assert chosen["head"] is None and chosen["target"] == chosen["draft"], (overlay, chosen)
        if selector:
            assert chosen["target"] == selector
        else:  # a plain label of the operator's choosing, not the GPU Operator's
            assert chosen["target"] and not any(k.startswith("nvidia.com/") for k in chosen["target"])


def test_ngram_overlay_drafts_in_the_coordinator_with_no_draft_pods():
    by_name = groups(one(rendered("overlays/ngram"), "RayCluster"))
    assert env_values(ray_container(by_name["head"]))["SPECDEC_DRAFT"] == "ngram"
    assert replica_bounds(by_name["draft"]) == (0, 0, 0)
    assert replica_bounds(by_name["target"]) == replica_bounds(base_groups()["target"])


def test_storage_class_overlay_names_a_class_for_the_rwx_volume():
    pvc = one(rendered("overlays/storage-class"), "PersistentVolumeClaim")
    assert pvc["spec"]["storageClassName"] and pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_next_cluster_serves_beside_the_first_behind_the_same_service_and_policies():
    """During an upgrade both RayClusters run: the Service reaches both heads, and each cluster's
    pods can talk Ray and worker gRPC among themselves as the first cluster's do."""
    first = base_raycluster()
    (second,) = [d for d in rendered("overlays/next-cluster") if d["kind"] == "RayCluster"]
    assert second["metadata"]["name"] != first["metadata"]["name"]
    assert changed_paths(first["spec"], second["spec"]) == set()
    selector = {"matchLabels": base_one("Service")["spec"]["selector"]}
    for cluster in (first, second):
        assert selector_matches(selector, pod_labels("head", cluster))
        head = pod_labels("head", cluster)
        for worker in ("target", "draft"):
            labels = pod_labels(worker, cluster)
            assert allowed(worker_port(worker), labels, head)
            assert allowed(int(first["spec"]["workerGroupSpecs"][0]["rayStartParams"]["node-manager-port"]),
                            labels, pod_labels("draft" if worker == "target" else "target", cluster))
        assert allowed(int(cluster["spec"]["headGroupSpec"]["rayStartParams"]["port"]), head,
                        pod_labels("target", cluster))
        assert selector_matches(base_one("PodDisruptionBudget")["spec"]["selector"], pod_labels("target", cluster))


def test_raycluster_groups_leave_kuberay_the_options_it_sets_itself():
    assert [g["groupName"] for g in base_raycluster()["spec"]["workerGroupSpecs"]] == ["target", "draft"]
    for name, group in base_groups().items():
        assert "block" not in group["rayStartParams"] and "address" not in group["rayStartParams"], name
