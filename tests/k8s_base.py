"""The Kubernetes manifests' rendered base as the manifest tests query it: its objects, the
RayCluster's groups and their containers' env, script and custom resources, the labels a pod of a
group gets, and whether the NetworkPolicies admit a connection; the ports and names the manifests
and specdec must agree on.
"""
from __future__ import annotations

import json
import shlex
import shutil
import sys
from functools import cache

import pytest
import yaml

from k8s_render import BASE, K8S, groups, one, ray_container, rendered

PUBLIC_PORT = 50051
HTTP_PORT = 8000
WORKER_PORT_ENV = {"target": "SPECDEC_TARGET_WORKER_PORT", "draft": "SPECDEC_DRAFT_WORKER_PORT"}
GPU = "nvidia.com/gpu"
CUSTOM_RESOURCE = {"head": "specdec_coordinator", "target": "specdec_target", "draft": "specdec_draft"}
# `ray start` options that open a listening port (head-only ones are only valid on the head).
RAY_PORT_PARAMS = {"port", "dashboard-port", "ray-client-server-port", "node-manager-port", "object-manager-port",
                   "runtime-env-agent-port", "dashboard-agent-grpc-port", "dashboard-agent-listen-port",
                   "metrics-export-port"}


needs_bash = pytest.mark.skipif(sys.platform == "win32" or shutil.which("bash") is None, reason="needs bash")


@cache
def base_docs() -> tuple[dict, ...]:
    """The base, parsed once (PyYAML is slow); callers must not modify what they get."""
    return tuple(rendered(BASE))


def base_one(kind: str, name: str | None = None) -> dict:
    return one(list(base_docs()), kind, name)


def base_all_docs() -> list[dict]:
    return list(base_docs())


def base_raycluster() -> dict:
    return base_one("RayCluster")


def base_groups() -> dict[str, dict]:
    return groups(base_raycluster())


def example_secret() -> dict:
    return yaml.safe_load((K8S / "secret.example.yaml").read_text())


def pod_labels(group_name: str, cluster: dict | None = None) -> dict[str, str]:
    """The labels a pod of this group gets: its template's plus the ones KubeRay adds."""
    cluster = cluster or base_raycluster()
    group = groups(cluster)[group_name]
    labels = dict(group["template"].get("metadata", {}).get("labels", {}))
    labels.update({"ray.io/cluster": cluster["metadata"]["name"],
                   "ray.io/node-type": "head" if group_name == "head" else "worker",
                   "ray.io/group": "headgroup" if group_name == "head" else group_name,
                   "ray.io/is-ray-node": "yes"})
    return labels


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def script_of(container: dict) -> str:
    assert container["command"][:2] == ["/bin/bash", "-c"], container["command"]
    assert len(container["args"]) == 1
    return container["args"][0]


def custom_resources(group: dict) -> dict:
    """--resources as `ray start` receives it: KubeRay writes --resources=<value> into a command
    that a shell runs (bash -c "$KUBERAY_GEN_RAY_START_CMD"), so parse it the way a shell does."""
    (arg,) = shlex.split(f"--resources={group['rayStartParams']['resources']}")
    return json.loads(arg.split("=", 1)[1])


def selector_matches(selector: dict, labels: dict) -> bool:
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def covers_port(port_entry: dict, port: int) -> bool:
    start = port_entry.get("port")
    if start is None:  # no port: all ports
        return True
    assert isinstance(start, int), f"named ports are not used here: {port_entry}"
    return start == port or start <= port <= port_entry.get("endPort", start)


def policies_for(labels: dict, docs: list[dict] | None = None) -> list[dict]:
    return [d for d in (docs or base_all_docs())
            if d["kind"] == "NetworkPolicy" and selector_matches(d["spec"]["podSelector"], labels)]


def allowed(port: int, dst_labels: dict, src_labels: dict | None) -> bool:
    """Would the NetworkPolicies admit TCP to `port` on a pod with dst_labels from a pod in the same
    namespace with src_labels (None: a client outside the namespace / cluster)?"""
    policies = policies_for(dst_labels)
    if not policies:
        return True  # not isolated
    for policy in policies:
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"].get("ingress", []):
            if not any(covers_port(p, port) for p in rule.get("ports", [{}])):
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                assert set(peer) == {"podSelector"}, f"only same-namespace pod peers are expected: {peer}"
                if src_labels is not None and selector_matches(peer["podSelector"], src_labels):
                    return True
    return False


def ray_ports(group_name: str) -> list[int]:
    params = base_groups()[group_name]["rayStartParams"]
    return [int(v) for k, v in params.items() if k in RAY_PORT_PARAMS]


def worker_port(role: str) -> int:
    return int(env_of(ray_container(base_groups()["head"]))[WORKER_PORT_ENV[role]]["value"])


def replica_bounds(group: dict) -> tuple[int, int, int]:
    """A worker group's (minReplicas, replicas, maxReplicas)."""
    return group["minReplicas"], group["replicas"], group["maxReplicas"]


MISSING = object()  # what changed_paths compares against where one side lacks a key


def changed_paths(a, b, path: str = "") -> set[str]:
    """The JSON-pointer-like paths at which `a` and `b` differ ("" when they differ as a whole)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return set().union(*(changed_paths(a.get(k, MISSING), b.get(k, MISSING), f"{path}/{k}")
                             for k in a.keys() | b.keys()))
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return set().union(*(changed_paths(x, y, f"{path}/{i}") for i, (x, y) in enumerate(zip(a, b))))
    return set() if a == b else {path}
