"""Offline checks of the Kubernetes manifests in k8s/ and of the Dockerfile.

- Built-in kinds (Service, NetworkPolicy, PVC, Secret, and every pod template inside the
  RayCluster) are validated against the Kubernetes OpenAPI schemas that the `kubernetes-validate`
  package ships (strict: unknown fields are errors). No cluster, no network.
- The RayCluster (ray.io/v1) is checked against KubeRay's documented fields: a whitelist of the
  spec fields that KubeRay 1.2 (the oldest version k8s/README.md supports) accepts, the required
  ones, and the types KubeRay's CRD demands (rayStartParams is a map of strings).
- Then what makes this deployment work: GPUs on every worker, Ray custom resources that pin the
  actors, gRPC probes on the coordinator's :50051, a NetworkPolicy that lets only the coordinator
  reach the workers' gRPC ports while Ray's own ports stay open inside the Ray cluster, a Service
  that targets :50051, and a head command that starts Ray, then `specdec serve`, and drains on
  SIGTERM (run here with stub `ray` / `specdec` programs).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
K8S_VERSION = "1.30.0"  # validate against this Kubernetes API version (bundled schema)

PUBLIC_PORT = 50051
HTTP_PORT = 8000
WORKER_PORT_ENV = {"target": "SPECDEC_TARGET_WORKER_PORT", "draft": "SPECDEC_DRAFT_WORKER_PORT"}
GPU = "nvidia.com/gpu"
CUSTOM_RESOURCE = {"head": "specdec_coordinator", "target": "specdec_target", "draft": "specdec_draft"}

# ray.io/v1 RayCluster fields as of KubeRay v1.2.0 (newer releases add more; we stay compatible).
RAYCLUSTER_SPEC_FIELDS = {"suspend", "autoscalerOptions", "headServiceAnnotations", "enableInTreeAutoscaling",
                          "headGroupSpec", "rayVersion", "workerGroupSpecs"}
HEAD_GROUP_FIELDS = {"serviceType", "headService", "enableIngress", "rayStartParams", "template"}
HEAD_GROUP_REQUIRED = {"rayStartParams", "template"}
WORKER_GROUP_FIELDS = {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template",
                       "scaleStrategy", "numOfHosts"}
WORKER_GROUP_REQUIRED = {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template"}
# `ray start` options that open a listening port (head-only ones are only valid on the head).
RAY_PORT_PARAMS = {"port", "dashboard-port", "ray-client-server-port", "node-manager-port", "object-manager-port",
                   "runtime-env-agent-port", "dashboard-agent-grpc-port", "dashboard-agent-listen-port",
                   "metrics-export-port"}


needs_bash = pytest.mark.skipif(sys.platform == "win32" or shutil.which("bash") is None, reason="needs bash")


# --- loading -----------------------------------------------------------------------------------


@cache
def _docs(name: str) -> tuple[dict, ...]:
    """Parsed once per file (PyYAML is slow); callers must not modify what they get."""
    return tuple(d for d in yaml.safe_load_all((K8S / name).read_text()) if d)


def _manifest_files() -> list[str]:
    return sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _all_docs() -> list[tuple[str, dict]]:
    return [(name, doc) for name in _manifest_files() for doc in _docs(name)]


def _one(kind: str, name: str | None = None) -> dict:
    found = [d for _, d in _all_docs() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected exactly one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _raycluster() -> dict:
    return _one("RayCluster")


def _groups() -> dict[str, dict]:
    """'head' -> headGroupSpec, then groupName -> workerGroupSpec."""
    spec = _raycluster()["spec"]
    groups = {"head": spec["headGroupSpec"]}
    for g in spec["workerGroupSpecs"]:
        groups[g["groupName"]] = g
    return groups


def _ray_container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]  # KubeRay's Ray container is containers[0]


def _pod_labels(group_name: str) -> dict[str, str]:
    """The labels a pod of this group gets: its template's plus the ones KubeRay adds."""
    cluster = _raycluster()
    group = _groups()[group_name]
    labels = dict(group["template"].get("metadata", {}).get("labels", {}))
    labels.update({"ray.io/cluster": cluster["metadata"]["name"],
                   "ray.io/node-type": "head" if group_name == "head" else "worker",
                   "ray.io/group": "headgroup" if group_name == "head" else group_name,
                   "ray.io/is-ray-node": "yes"})
    return labels


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _script(container: dict) -> str:
    assert container["command"][:2] == ["/bin/bash", "-c"], container["command"]
    assert len(container["args"]) == 1
    return container["args"][0]


def _custom_resources(group: dict) -> dict:
    """--resources as `ray start` receives it: KubeRay writes --resources=<value> into a command
    that a shell runs (bash -c "$KUBERAY_GEN_RAY_START_CMD"), so parse it the way a shell does."""
    (arg,) = shlex.split(f"--resources={group['rayStartParams']['resources']}")
    return json.loads(arg.split("=", 1)[1])


def _selector_matches(selector: dict, labels: dict) -> bool:
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


def _covers(port_entry: dict, port: int) -> bool:
    start = port_entry.get("port")
    if start is None:  # no port: all ports
        return True
    assert isinstance(start, int), f"named ports are not used here: {port_entry}"
    return start == port or start <= port <= port_entry.get("endPort", start)


def _policies_for(labels: dict) -> list[dict]:
    return [d for _, d in _all_docs()
            if d["kind"] == "NetworkPolicy" and _selector_matches(d["spec"]["podSelector"], labels)]


def _allowed(port: int, dst_labels: dict, src_labels: dict | None) -> bool:
    """Would the NetworkPolicies admit TCP to `port` on a pod with dst_labels from a pod in the same
    namespace with src_labels (None: a client outside the namespace / cluster)?"""
    policies = _policies_for(dst_labels)
    if not policies:
        return True  # not isolated
    for policy in policies:
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"].get("ingress", []):
            if not any(_covers(p, port) for p in rule.get("ports", [{}])):
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                assert set(peer) == {"podSelector"}, f"only same-namespace pod peers are expected: {peer}"
                if src_labels is not None and _selector_matches(peer["podSelector"], src_labels):
                    return True
    return False


def _ray_ports(group_name: str) -> list[int]:
    params = _groups()[group_name]["rayStartParams"]
    return [int(v) for k, v in params.items() if k in RAY_PORT_PARAMS]


def _worker_port(role: str) -> int:
    return int(_env(_ray_container(_groups()["head"]))[WORKER_PORT_ENV[role]]["value"])


# --- schema validation -------------------------------------------------------------------------


def test_manifest_kinds_are_the_expected_ones():
    kinds = sorted(d["kind"] for _, d in _all_docs())
    assert kinds == sorted(["NetworkPolicy", "NetworkPolicy", "PersistentVolumeClaim", "RayCluster", "Secret",
                            "Service"])


@pytest.mark.parametrize("name,index", [(n, i) for n in _manifest_files() for i, d in enumerate(_docs(n))
                                        if d["apiVersion"] != "ray.io/v1"])
def test_builtin_kinds_validate_against_the_kubernetes_schema(name, index):
    doc = _docs(name)[index]
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("group_name", ["head", "target", "draft"])
def test_raycluster_pod_templates_validate_against_the_kubernetes_schema(group_name):
    template = _groups()[group_name]["template"]
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"specdec-{group_name}"},
               "template": template}
    kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)


def test_raycluster_uses_only_documented_kuberay_fields():
    cluster = _raycluster()
    assert cluster["apiVersion"] == "ray.io/v1"
    assert set(cluster) == {"apiVersion", "kind", "metadata", "spec"}
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", cluster["metadata"]["name"])
    spec = cluster["spec"]
    assert set(spec) <= RAYCLUSTER_SPEC_FIELDS, set(spec) - RAYCLUSTER_SPEC_FIELDS

    head = spec["headGroupSpec"]
    assert set(head) <= HEAD_GROUP_FIELDS, set(head) - HEAD_GROUP_FIELDS
    assert HEAD_GROUP_REQUIRED <= set(head)
    assert head["template"]["spec"]["containers"]

    workers = spec["workerGroupSpecs"]
    assert [g["groupName"] for g in workers] == ["target", "draft"]
    for g in workers:
        assert set(g) <= WORKER_GROUP_FIELDS, set(g) - WORKER_GROUP_FIELDS
        assert WORKER_GROUP_REQUIRED <= set(g), WORKER_GROUP_REQUIRED - set(g)
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", g["groupName"])
        for key in ("replicas", "minReplicas", "maxReplicas"):
            assert isinstance(g[key], int) and not isinstance(g[key], bool), key
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert g["template"]["spec"]["containers"]

    for name, group in _groups().items():
        params = group["rayStartParams"]
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in params.items()), \
            f"{name}: rayStartParams must be a map of strings (the CRD rejects numbers)"
        assert "block" not in params and "address" not in params, "KubeRay sets these itself"
    assert isinstance(spec["enableInTreeAutoscaling"], bool)


def test_rayversion_matches_the_image():
    dockerfile = (REPO / "Dockerfile").read_text()
    m = re.search(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.M)
    assert m and _raycluster()["spec"]["rayVersion"] == m.group(1)


# --- what the pods run -------------------------------------------------------------------------


def test_kuberay_command_overwrite_and_every_ray_container_starts_ray():
    assert _raycluster()["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    for name, group in _groups().items():
        script = _script(_ray_container(group))
        # The inner bash keeps the quoted --resources JSON in one argument.
        assert 'bash -c "$KUBERAY_GEN_RAY_START_CMD"' in script, name
        assert "ulimit -n 65536" in script, name


@needs_bash
@pytest.mark.parametrize("group_name", ["head", "target", "draft"])
def test_container_scripts_are_valid_bash(group_name):
    script = _script(_ray_container(_groups()[group_name]))
    result = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, result.stderr


def test_head_runs_specdec_serve_on_the_public_port():
    script = _script(_ray_container(_groups()["head"]))
    serve = script[script.index("specdec serve"):]
    for flag in ("--ray-address auto", f"--port {PUBLIC_PORT}", f"--http-port {HTTP_PORT}", "--host 0.0.0.0",
                 "--worker-host node-ip",
                 '--target "$SPECDEC_TARGET"', '--draft "$SPECDEC_DRAFT"', '--device "$SPECDEC_DEVICE"'):
        assert flag in serve, flag
    assert "--auth-token" not in script, "the token comes from the environment, not the command line"


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def _run_head_script(tmp_path: Path, specdec_body: str, *, serve_starts: int = 1,
                     sigterm: bool = True) -> tuple[int, list[str]]:
    """Run the head container's script with stub `fake-ray-start` (as $KUBERAY_GEN_RAY_START_CMD),
    `ray` and `specdec` on PATH; once `specdec serve` has started `serve_starts` times, send SIGTERM
    (if `sigterm`). Returns the exit status and the stubs' log lines."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "log"
    pid_file = tmp_path / "ray.pid"
    _stub(bin_dir / "fake-ray-start", f'echo $$ > {pid_file}\necho "ray-start $*" >> {log}\n'
                                      'trap "exit 0" TERM\nwhile :; do sleep 0.05; done\n')
    # `ray health-check` succeeds once the fake head has started (like the real GCS), waiting
    # up to a second for it.
    _stub(bin_dir / "ray", f'echo "ray $*" >> {log}\n'
                           f'if [ "$1" = health-check ]; then '
                           f'for i in $(seq 50); do [ -s {pid_file} ] && exit 0; sleep 0.02; done; exit 1; fi\n'
                           f'if [ "$1" = stop ] && [ -s {pid_file} ]; then kill "$(cat {pid_file})" 2>/dev/null; fi\n'
                           'exit 0\n')
    _stub(bin_dir / "specdec", specdec_body.replace("LOG", str(log)).replace("RAY_PID_FILE", str(pid_file)))
    container = _ray_container(_groups()["head"])
    env = {k: e["value"] for k, e in _env(container).items() if "value" in e}
    env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
               SPECDEC_AUTH_TOKEN="test-token", SPECDEC_RESTART_DELAY_S="0.05",
               KUBERAY_GEN_RAY_START_CMD="fake-ray-start --head --resources='{\"specdec_coordinator\": 1}' --block")
    proc = subprocess.Popen(container["command"] + container["args"], env=env, cwd=tmp_path,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def lines() -> list[str]:
        return log.read_text().splitlines() if log.exists() else []

    try:
        deadline = time.monotonic() + 30  # generous: only a failing script waits this long
        while proc.poll() is None and time.monotonic() < deadline:
            if sum(x.startswith("specdec serve") for x in lines()) >= serve_starts:
                break
            time.sleep(0.02)
        if sigterm and proc.poll() is None:
            time.sleep(0.2)  # let the script reach its wait
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the stubs (same session)
        except ProcessLookupError:
            pass
    return code, lines()


_SERVE_UNTIL_SIGTERM = ('echo "specdec $* token=$SPECDEC_AUTH_TOKEN" >> LOG\n'
                        "trap 'echo drained >> LOG; exit 0' TERM\n"
                        "while :; do sleep 0.05; done\n")


@needs_bash
def test_head_script_starts_ray_then_serve_and_drains_on_sigterm(tmp_path):
    code, lines = _run_head_script(tmp_path, _SERVE_UNTIL_SIGTERM)
    assert code == 0, lines
    # The generated command ran through a shell: the quoted JSON is one argument.
    assert 'ray-start --head --resources={"specdec_coordinator": 1} --block' in lines, lines
    (serve,) = [x for x in lines if x.startswith("specdec serve")]
    assert "--ray-address auto" in serve and "--target /models/target" in serve and "token=test-token" in serve
    last_check = max(i for i, x in enumerate(lines) if x.startswith("ray health-check"))
    assert lines.index('ray-start --head --resources={"specdec_coordinator": 1} --block') < lines.index(serve)
    assert last_check < lines.index(serve) < lines.index("drained")
    assert lines.index("drained") < next(i for i, x in enumerate(lines) if x.startswith("ray stop"))


@needs_bash
def test_head_script_restarts_serve_but_not_ray(tmp_path):
    code, lines = _run_head_script(tmp_path, 'echo "specdec $*" >> LOG\nexit 2\n', serve_starts=3)
    assert sum(x.startswith("specdec serve") for x in lines) >= 3, lines
    assert sum(x.startswith("ray-start") for x in lines) == 1, lines
    assert code != 0 and lines[-1].startswith("ray stop"), (code, lines)


@needs_bash
def test_head_script_fails_the_container_when_ray_dies(tmp_path):
    body = 'kill "$(cat RAY_PID_FILE)"\n' + _SERVE_UNTIL_SIGTERM
    code, lines = _run_head_script(tmp_path, body, sigterm=False)
    assert code == 1, lines
    assert "drained" in lines, lines  # serve was told to stop first
    assert sum(x.startswith("specdec serve") for x in lines) == 1, lines


# --- placement and resources -------------------------------------------------------------------


def test_ray_custom_resources_pin_each_actor_to_its_group():
    for name, group in _groups().items():
        resources = _custom_resources(group)
        assert resources == {CUSTOM_RESOURCE[name]: 1}, (name, resources)


def test_every_worker_container_requests_a_gpu_and_runs_on_gpu_nodes():
    for name, group in _groups().items():
        if name == "head":
            continue
        pod = group["template"]["spec"]
        for container in pod["containers"]:
            res = container["resources"]
            assert int(res["requests"][GPU]) >= 1 and res["requests"][GPU] == res["limits"][GPU], name
        assert group["rayStartParams"]["num-gpus"] == _ray_container(group)["resources"]["limits"][GPU]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_head_is_a_cpu_pod_with_no_ray_cpus():
    head = _groups()["head"]
    for container in head["template"]["spec"]["containers"]:
        for kind in ("requests", "limits"):
            assert GPU not in container["resources"].get(kind, {})
    assert "tolerations" not in head["template"]["spec"]
    assert head["rayStartParams"]["num-cpus"] == "0"


def test_every_container_has_cpu_and_memory_requests_and_limits():
    for name, group in _groups().items():
        for container in group["template"]["spec"]["containers"]:
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][kind]), (name, kind)


def test_models_volume_is_mounted_read_only_everywhere():
    pvc = _one("PersistentVolumeClaim")
    for name, group in _groups().items():
        pod = group["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        (mount,) = [m for m in _ray_container(group)["volumeMounts"] if m["mountPath"] == "/models"]
        assert mount["readOnly"] is True, name
        claim = volumes[mount["name"]]["persistentVolumeClaim"]
        assert claim["claimName"] == pvc["metadata"]["name"] and claim["readOnly"] is True, name
    env = _env(_ray_container(_groups()["head"]))
    assert env["SPECDEC_TARGET"]["value"].startswith("/models/")


def test_auth_token_comes_from_the_secret():
    secret = _one("Secret")
    env = _env(_ray_container(_groups()["head"]))
    ref = env["SPECDEC_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"]
    assert ref["key"] in secret["stringData"]
    assert not ref.get("optional", False)


# --- probes, ports, network policy, service ----------------------------------------------------


def test_coordinator_probes_are_grpc_health_checks_on_the_public_port():
    container = _ray_container(_groups()["head"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        spec = container[probe]
        assert set(spec) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"grpc"}, probe
        assert spec["grpc"]["port"] == PUBLIC_PORT, probe
    assert container["readinessProbe"]["grpc"]["service"] == "specdec.v1.Generation"
    assert any(p["containerPort"] == PUBLIC_PORT and p["name"] == "grpc" for p in container["ports"])


def test_worker_ports_are_fixed_and_the_same_in_every_pod():
    ports = {role: _worker_port(role) for role in WORKER_PORT_ENV}
    assert len(set(ports.values())) == 2 and PUBLIC_PORT not in ports.values()
    for name, group in _groups().items():
        env = _env(_ray_container(group))
        for role, var in WORKER_PORT_ENV.items():
            assert int(env[var]["value"]) == ports[role], (name, var)
        if name != "head":
            assert ports[name] in [p["containerPort"] for p in _ray_container(group)["ports"]]
    # Not inside any range Ray may use.
    for name, group in _groups().items():
        params = group["rayStartParams"]
        low, high = int(params["min-worker-port"]), int(params["max-worker-port"])
        for port in ports.values():
            assert not low <= port <= high and port not in _ray_ports(name)


def test_network_policy_isolates_the_workers_grpc_ports_to_the_coordinator():
    head = _pod_labels("head")
    for worker in ("target", "draft"):
        labels = _pod_labels(worker)
        assert _policies_for(labels), f"{worker} pods are not selected by any NetworkPolicy"
        for role in WORKER_PORT_ENV:
            port = _worker_port(role)
            assert _allowed(port, labels, head), (worker, port)
            assert not _allowed(port, labels, _pod_labels("target" if worker == "draft" else "draft"))
            assert not _allowed(port, labels, labels)
            assert not _allowed(port, labels, {"app": "something-else"})
            assert not _allowed(port, labels, None)
    # The same holds rule by rule: every rule that opens a worker gRPC port names only pod peers
    # that select the head and no worker.
    for policy in _policies_for(_pod_labels("target")) + _policies_for(_pod_labels("draft")):
        for rule in policy["spec"]["ingress"]:
            if any(_covers(p, _worker_port(r)) for p in rule.get("ports", [{}]) for r in WORKER_PORT_ENV):
                assert rule.get("from"), rule
                for peer in rule["from"]:
                    assert set(peer) == {"podSelector"}
                    assert _selector_matches(peer["podSelector"], head)
                    assert not _selector_matches(peer["podSelector"], _pod_labels("target"))
                    assert not _selector_matches(peer["podSelector"], _pod_labels("draft"))


def test_network_policy_opens_the_public_port_and_keeps_ray_inside_the_cluster():
    head = _pod_labels("head")
    assert _policies_for(head), "the coordinator pod is not selected by any NetworkPolicy"
    for public in (PUBLIC_PORT, HTTP_PORT):
        assert _allowed(public, head, None) and _allowed(public, head, {"app": "client"})
    members = [_pod_labels(g) for g in _groups()]
    for name in _groups():
        dst = _pod_labels(name)
        params = _groups()[name]["rayStartParams"]
        ports = _ray_ports(name) + [int(params["min-worker-port"]), int(params["max-worker-port"])]
        for port in ports:
            for src in members:
                assert _allowed(port, dst, src), (name, port, src)
            assert not _allowed(port, dst, {"app": "something-else"}), (name, port)
            assert not _allowed(port, dst, None), (name, port)


def test_service_targets_the_coordinator_on_its_grpc_and_http_ports():
    service = _one("Service")
    selector = service["spec"]["selector"]
    assert _selector_matches({"matchLabels": selector}, _pod_labels("head"))
    assert not _selector_matches({"matchLabels": selector}, _pod_labels("target"))
    assert not _selector_matches({"matchLabels": selector}, _pod_labels("draft"))
    grpc_port, http_port = service["spec"]["ports"]
    assert grpc_port["port"] == PUBLIC_PORT and grpc_port["targetPort"] == PUBLIC_PORT
    assert grpc_port["appProtocol"] == "grpc" and grpc_port["protocol"] == "TCP"
    assert http_port["port"] == HTTP_PORT and http_port["targetPort"] == HTTP_PORT
    assert http_port["appProtocol"] == "http" and http_port["protocol"] == "TCP"
    container_ports = {p["name"]: p["containerPort"] for p in _ray_container(_groups()["head"])["ports"]}
    assert container_ports["grpc"] == PUBLIC_PORT and container_ports["http"] == HTTP_PORT


# --- kustomize, Dockerfile ---------------------------------------------------------------------


def test_kustomization_lists_every_manifest_but_the_example_secret():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization" and kustomization["namespace"]
    resources = kustomization["resources"]
    assert sorted(resources) == sorted(n for n in _manifest_files() if n != "secret.example.yaml")
    images = {i["name"] for i in kustomization["images"]}
    for group in _groups().values():
        for container in group["template"]["spec"]["containers"]:
            assert container["image"] in images


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
    for group in _groups().values():
        assert group["template"]["spec"]["securityContext"]["runAsUser"] == int(user)


def test_dockerignore_keeps_the_venv_and_git_out_of_the_build_context():
    lines = [x.strip() for x in (REPO / ".dockerignore").read_text().splitlines()
             if x.strip() and not x.startswith("#")]
    assert lines[0] == "*"  # allow-list
    assert not any(x.startswith("!") and (".venv" in x or ".git" in x) for x in lines)
    for needed in ("pyproject.toml", "specdec/", "coordinator/", "draft_worker/", "target_worker/"):
        assert f"!{needed}" in lines
