"""Offline checks of the Kubernetes manifests in k8s/ (as `kubectl kustomize` renders them: the
base and every overlay) and of the Dockerfile. Schema validation is in test_k8s_schemas.py; what
the deployment needs is checked here and in the test_k8s_*.py files beside it:

- here: the Ray version, GPUs on every worker and Ray custom resources that pin the actors, the
  model volume and the token's Secret, the PodDisruptionBudget and PodMonitor, the kustomization
  and the Dockerfile;
- test_k8s_container_scripts.py: the head command (starts Ray, then `specdec serve`, drains on
  SIGTERM, kills a serve that overruns) and the init container that fills the model volume, run
  here with stub programs;
- test_k8s_autoscaling.py: worker groups whose bounds are the head's replica settings, as Ray's
  autoscaler reads them;
- test_k8s_overlays.py: each overlay changes only what it is for;
- test_k8s_network.py: probes, the workers' fixed ports, the NetworkPolicy and the Service.
"""
from __future__ import annotations

import json
import re

import yaml

from k8s_base import (
    CUSTOM_RESOURCE,
    GPU,
    HTTP_PORT,
    base_groups,
    base_one,
    base_raycluster,
    custom_resources,
    env_of,
    example_secret,
    pod_labels,
    selector_matches,
)
from k8s_render import K8S, REPO, VARIANTS, groups, one, ray_container, rendered


def test_rayversion_matches_the_image():
    dockerfile = (REPO / "Dockerfile").read_text()
    m = re.search(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.M)
    assert m and base_raycluster()["spec"]["rayVersion"] == m.group(1)

# --- placement and resources -------------------------------------------------------------------


def test_ray_custom_resources_pin_each_actor_to_its_group():
    for name, group in base_groups().items():
        resources = custom_resources(group)
        assert resources == {CUSTOM_RESOURCE[name]: 1}, (name, resources)


def test_every_worker_container_requests_a_gpu_and_runs_on_gpu_nodes():
    for name, group in base_groups().items():
        if name == "head":
            continue
        pod = group["template"]["spec"]
        for container in pod["containers"]:
            res = container["resources"]
            assert int(res["requests"][GPU]) >= 1 and res["requests"][GPU] == res["limits"][GPU], name
        assert group["rayStartParams"]["num-gpus"] == ray_container(group)["resources"]["limits"][GPU]
        assert "nodeSelector" not in pod, "the base selects GPU nodes by the GPU request alone (overlays pin)"
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_head_is_a_cpu_pod_with_no_ray_cpus():
    head = base_groups()["head"]
    for container in head["template"]["spec"]["containers"]:
        for kind in ("requests", "limits"):
            assert GPU not in container["resources"].get(kind, {})
    assert "tolerations" not in head["template"]["spec"]
    assert head["rayStartParams"]["num-cpus"] == "0"


def test_every_container_has_cpu_and_memory_requests_and_limits():
    for name, group in base_groups().items():
        for container in group["template"]["spec"]["containers"]:
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][kind]), (name, kind)


def test_models_volume_is_read_only_everywhere_but_in_the_fetch_init_container():
    pvc = base_one("PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # written on the head's node, read on others
    for name, group in base_groups().items():
        pod = group["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        (mount,) = [m for m in ray_container(group)["volumeMounts"] if m["mountPath"] == "/models"]
        assert mount["readOnly"] is True, name
        claim = volumes[mount["name"]]["persistentVolumeClaim"]
        assert claim["claimName"] == pvc["metadata"]["name"], name
        # Only the head pod writes (its init container); on workers even the claim is read-only.
        assert claim.get("readOnly", False) is (name != "head"), name
        for init in pod.get("initContainers", []):
            assert name == "head" and init["name"] == "fetch-models", (name, init["name"])
            (init_mount,) = [m for m in init["volumeMounts"] if m["name"] == mount["name"]]
            assert init_mount["mountPath"] == "/models" and not init_mount.get("readOnly", False)
    env = env_of(ray_container(base_groups()["head"]))
    assert env["SPECDEC_TARGET"]["value"].startswith("/models/")


def test_auth_token_comes_from_the_secret():
    secret = example_secret()
    env = env_of(ray_container(base_groups()["head"]))
    ref = env["SPECDEC_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"]
    assert ref["key"] in secret["stringData"]
    assert not ref.get("optional", False)

# --- disruption budget and metrics -------------------------------------------------------------


def test_disruption_budget_lets_one_worker_pod_go_at_a_time_and_leaves_the_head_alone():
    pdb = base_one("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    selector = pdb["spec"]["selector"]
    assert selector_matches(selector, pod_labels("target")) and selector_matches(selector, pod_labels("draft"))
    assert not selector_matches(selector, pod_labels("head"))


def test_podmonitor_scrapes_the_coordinator_with_the_token_and_ray_on_every_pod():
    docs = rendered("overlays/podmonitor")
    monitor = one(docs, "PodMonitor")
    cluster = one(docs, "RayCluster")
    endpoints = {e["port"]: e for e in monitor["spec"]["podMetricsEndpoints"]}
    assert set(endpoints) == {"http", "metrics"}
    for name, group in groups(cluster).items():
        labels = pod_labels(name, cluster)
        assert selector_matches(monitor["spec"]["selector"], labels), name
        ports = {p["name"]: p["containerPort"] for p in ray_container(group)["ports"]}
        assert ports["metrics"] == int(group["rayStartParams"]["metrics-export-port"]), name
        if name == "head":
            assert ports["http"] == HTTP_PORT  # the coordinator's /metrics
    credentials = endpoints["http"]["authorization"]["credentials"]
    assert endpoints["http"]["authorization"]["type"] == "Bearer"
    secret = example_secret()
    assert credentials["name"] == secret["metadata"]["name"] and credentials["key"] in secret["stringData"]
    assert all(e["path"] == "/metrics" for e in endpoints.values())


def test_podmonitor_overlay_lets_prometheus_reach_ray_metrics_from_its_namespace():
    docs = rendered("overlays/podmonitor")
    policy = one(docs, "NetworkPolicy", "specdec-metrics")
    cluster = one(docs, "RayCluster")
    ray_metrics = int(base_groups()["head"]["rayStartParams"]["metrics-export-port"])
    for name in groups(cluster):
        assert selector_matches(policy["spec"]["podSelector"], pod_labels(name, cluster)), name
    (rule,) = policy["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [ray_metrics]
    (peer,) = rule["from"]
    assert set(peer) == {"namespaceSelector"}  # Prometheus' namespace, not everyone

# --- kustomize, Dockerfile ---------------------------------------------------------------------


def test_base_kustomization_lists_every_base_manifest_and_not_the_example_secret():
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization" and kustomization["namespace"]
    resources = kustomization["resources"]
    assert sorted(resources) == sorted(p.name for p in (K8S / "base").glob("*.yaml") if p.name != "kustomization.yaml")
    assert not (K8S / "base" / "secret.example.yaml").exists() and (K8S / "secret.example.yaml").exists()
    (image,) = kustomization["images"]
    wanted = f"{image['newName']}:{image['newTag']}"
    for variant in VARIANTS:  # every container of every variant runs the one image
        for name, group in groups(one(rendered(variant), "RayCluster")).items():
            pod = group["template"]["spec"]
            for container in pod["containers"] + pod.get("initContainers", []):
                assert container["image"] == wanted, (variant, name, container["name"])


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_entrypoint_is_specdec_and_it_installs_the_package():
    instructions = _dockerfile_instructions()
    entrypoints = [rest for word, rest in instructions if word == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["specdec"]
    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert "pip install /opt/specdec" in runs and '--index-url "${TORCH_INDEX_URL}"' in runs
    args = dict(rest.split("=", 1) for word, rest in instructions if word == "ARG" and "=" in rest)
    assert args["BASE_IMAGE"].startswith("nvidia/cuda:")
    assert args["TORCH_VERSION"] == re.search(r'"torch==([^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    user = [rest for word, rest in instructions if word == "USER"][-1]
    for group in base_groups().values():
        assert group["template"]["spec"]["securityContext"]["runAsUser"] == int(user)


def test_dockerignore_keeps_the_venv_and_git_out_of_the_build_context():
    lines = [x.strip() for x in (REPO / ".dockerignore").read_text().splitlines()
             if x.strip() and not x.startswith("#")]
    assert lines[0] == "*"  # allow-list
    assert not any(x.startswith("!") and (".venv" in x or ".git" in x) for x in lines)
    for needed in ("pyproject.toml", "specdec/", "specdec_app/", "coordinator/", "draft_worker/", "target_worker/"):
        assert f"!{needed}" in lines
