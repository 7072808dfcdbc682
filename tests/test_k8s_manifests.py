"""Offline checks of the Kubernetes manifests in k8s/ (as `kubectl kustomize` renders them: the
base and every overlay) and of the Dockerfile. Schema validation is in test_k8s_schemas.py; this
file checks what makes the deployment work:

- autoscaling: in-tree autoscaling on, worker groups whose minReplicas / maxReplicas are the head's
  SPECDEC_MIN_REPLICAS / SPECDEC_MAX_REPLICAS, no draft pods with the n-gram drafter;
- GPUs on every worker, Ray custom resources that pin the actors, each overlay changing only what
  it is for;
- probes (startup long enough for the workers and the models, liveness that does not depend on
  specdec, readiness from gRPC health), a termination grace period longer than the drain and stop
  time, and a head command that starts Ray, then `specdec serve`, drains on SIGTERM and kills a
  serve that overruns (run here with stub `ray` / `specdec` programs);
- the init container that fills the model volume (run here with a stub huggingface_hub);
- the NetworkPolicy (only the coordinator reaches the workers' gRPC ports, Ray's ports stay among
  Ray pods), the Service, the PodDisruptionBudget, the PodMonitor.
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
import textwrap
import time
from functools import cache
from pathlib import Path

import pytest
import yaml

from k8s_render import BASE, K8S, OVERLAYS, REPO, VARIANTS, env_values, groups, kubectl, one, ray_container, rendered

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


# --- loading -----------------------------------------------------------------------------------


@cache
def _base_docs() -> tuple[dict, ...]:
    """The base, parsed once (PyYAML is slow); callers must not modify what they get."""
    return tuple(rendered(BASE))


def _one(kind: str, name: str | None = None) -> dict:
    return one(list(_base_docs()), kind, name)


def _all_docs() -> list[dict]:
    return list(_base_docs())


def _raycluster() -> dict:
    return _one("RayCluster")


def _groups() -> dict[str, dict]:
    return groups(_raycluster())


def _ray_container(group: dict) -> dict:
    return ray_container(group)


def _secret() -> dict:
    return yaml.safe_load((K8S / "secret.example.yaml").read_text())


def _pod_labels(group_name: str, cluster: dict | None = None) -> dict[str, str]:
    """The labels a pod of this group gets: its template's plus the ones KubeRay adds."""
    cluster = cluster or _raycluster()
    group = groups(cluster)[group_name]
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


def _policies_for(labels: dict, docs: list[dict] | None = None) -> list[dict]:
    return [d for d in (docs or _all_docs())
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
                     sigterm: bool = True, env_overrides: dict | None = None) -> tuple[int, list[str]]:
    """Run the head container's script with stub `fake-ray-start` (as $KUBERAY_GEN_RAY_START_CMD),
    `ray` and `specdec` on PATH; once `specdec serve` has started `serve_starts` times (and, if its
    stub logs TRAP_SET, has set its SIGTERM trap), send SIGTERM (if `sigterm`). Returns the exit
    status and the stubs' log lines."""
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
    env.update(env_overrides or {})
    proc = subprocess.Popen(container["command"] + container["args"], env=env, cwd=tmp_path,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def lines() -> list[str]:
        return log.read_text().splitlines() if log.exists() else []

    # A stub that traps SIGTERM says when its trap is set: a SIGTERM forwarded before would kill
    # it on a slow machine, whatever fixed pause came first.
    started = TRAP_SET if TRAP_SET in specdec_body else "specdec serve"
    try:
        deadline = time.monotonic() + 30  # generous: only a failing script waits this long
        while proc.poll() is None and time.monotonic() < deadline:
            if sum(x.startswith(started) for x in lines()) >= serve_starts:
                break
            time.sleep(0.02)
        if sigterm and proc.poll() is None:
            # The head script sets serve_pid (which its SIGTERM trap needs) right after it forks the
            # stub, long before the stub has started and logged; this pause only covers a head
            # script descheduled in between.
            time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the stubs (same session)
        except ProcessLookupError:
            pass
    return code, lines()


TRAP_SET = "trap set"
_SERVE_UNTIL_SIGTERM = ('echo "specdec $* token=$SPECDEC_AUTH_TOKEN" >> LOG\n'
                        "trap 'echo drained >> LOG; exit 0' TERM\n"
                        f"echo '{TRAP_SET}' >> LOG\n"
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


@needs_bash
def test_head_script_kills_a_serve_that_overruns_its_grace_period(tmp_path):
    ignores_sigterm = ('echo "specdec $*" >> LOG\n'
                       "trap 'echo term-ignored >> LOG' TERM\n"
                       f"echo '{TRAP_SET}' >> LOG\n"
                       "while :; do sleep 0.05; done\n")
    code, lines = _run_head_script(tmp_path, ignores_sigterm,
                                   env_overrides={"SPECDEC_GRACE_PERIOD": "0.3", "SPECDEC_STOP_SECONDS": "0.3"})
    assert code == 128 + signal.SIGKILL, (code, lines)  # the serve's status: killed
    assert "term-ignored" in lines, lines
    assert lines.index("term-ignored") < next(i for i, x in enumerate(lines) if x.startswith("ray stop"))
    (serve,) = [x for x in lines if x.startswith("specdec serve")]
    assert "--grace-period 0.3" in serve


# --- the init container that fills the model volume -------------------------------------------

FAKE_HUB = """
import json, os, pathlib

def snapshot_download(repo_id, *, revision=None, local_dir=None, ignore_patterns=None, **kwargs):
    with open(os.environ["FAKE_HUB_LOG"], "a") as log:
        log.write(json.dumps({"repo": repo_id, "revision": revision, "dir": str(local_dir),
                              "endpoint": os.environ.get("HF_ENDPOINT"),
                              "offline": os.environ.get("HF_HUB_OFFLINE"), "ignore": ignore_patterns}) + "\\n")
    if repo_id in os.environ.get("FAKE_HUB_FAIL", "").split(","):
        raise OSError("connection reset")
    path = pathlib.Path(local_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    return str(path)
"""


def _fetch_container(variant: str = BASE) -> dict:
    head = groups(one(rendered(variant), "RayCluster"))["head"]
    (init,) = head["template"]["spec"]["initContainers"]
    assert init["name"] == "fetch-models" and init["command"] == ["python", "-c"]
    return init


def _run_fetch(tmp_path: Path, variant: str = BASE, **env_overrides: str) -> tuple[int, list[dict], str]:
    """Run the fetch-models script as the init container would, with a stub huggingface_hub that
    logs its calls and writes a config.json; returns the exit status, the calls and stderr."""
    init = _fetch_container(variant)
    fake = tmp_path / "fake-hub"
    (fake / "huggingface_hub").mkdir(parents=True, exist_ok=True)
    (fake / "huggingface_hub" / "__init__.py").write_text(FAKE_HUB)
    log = tmp_path / "hub-calls"
    log.unlink(missing_ok=True)
    env = {**env_values(init), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(fake),
           "SPECDEC_MODELS_DIR": str(tmp_path / "models"), "FAKE_HUB_LOG": str(log), **env_overrides}
    result = subprocess.run([sys.executable, "-c", init["args"][0]], env=env, capture_output=True, text=True,
                            timeout=60)
    calls = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return result.returncode, calls, result.stderr


def test_fetch_models_downloads_each_model_once_then_needs_no_network(tmp_path):
    env = env_values(_fetch_container())
    code, calls, err = _run_fetch(tmp_path)
    assert code == 0, err
    assert [(c["repo"], c["revision"], c["dir"]) for c in calls] == [
        (env["SPECDEC_TARGET_REPO"], None, str(tmp_path / "models" / "target")),
        (env["SPECDEC_DRAFT_REPO"], None, str(tmp_path / "models" / "draft"))]
    assert all(c["endpoint"] == env["HF_ENDPOINT"] and c["offline"] == "0" for c in calls)
    assert all("*.bin" in c["ignore"] for c in calls)
    # Restarted: both snapshots are there, the Hub is not asked again.
    code, calls, err = _run_fetch(tmp_path)
    assert code == 0 and calls == [], (err, calls)


def test_fetch_models_fetches_again_when_the_revision_changes_and_uses_the_mirror(tmp_path):
    assert _run_fetch(tmp_path)[0] == 0
    mirror = "https://hf-mirror.internal.example"
    code, calls, err = _run_fetch(tmp_path, SPECDEC_TARGET_REPO="acme/target-model@v2", HF_ENDPOINT=mirror)
    assert code == 0, err
    assert [(c["repo"], c["revision"], c["endpoint"]) for c in calls] == [("acme/target-model", "v2", mirror)]


def test_fetch_models_failing_download_fails_the_pod_and_is_retried(tmp_path):
    repo = env_values(_fetch_container())["SPECDEC_TARGET_REPO"]
    code, calls, err = _run_fetch(tmp_path, FAKE_HUB_FAIL=repo)
    assert code != 0 and "connection reset" in err
    assert not (tmp_path / "models" / "target" / ".specdec-snapshot").exists()
    code, calls, err = _run_fetch(tmp_path)  # the kubelet restarts the init container
    assert code == 0 and [c["repo"] for c in calls][0] == repo, (err, calls)


def test_fetch_models_with_the_ngram_overlay_fetches_only_the_target(tmp_path):
    code, calls, err = _run_fetch(tmp_path, "overlays/ngram")
    assert code == 0, err
    assert [c["dir"] for c in calls] == [str(tmp_path / "models" / "target")]
    assert not (tmp_path / "models" / "draft").exists()


# --- replicas and autoscaling ------------------------------------------------------------------


def _bounds(group: dict) -> tuple[int, int, int]:
    return group["minReplicas"], group["replicas"], group["maxReplicas"]


def _check_replica_bounds(cluster: dict) -> None:
    """The worker groups' replicas / minReplicas / maxReplicas are what `specdec serve` will ask
    for, given the head's replica settings."""
    by_name = groups(cluster)
    env = env_values(ray_container(by_name["head"]))
    lowest, start, highest = (int(env[f"SPECDEC_{x}REPLICAS"]) for x in ("MIN_", "", "MAX_"))
    assert 1 <= lowest <= start <= highest
    # One target pod per target replica: KubeRay's bounds are specdec's.
    assert _bounds(by_name["target"]) == (lowest, start, highest)
    if env["SPECDEC_DRAFT"] in ("ngram", "none"):
        assert _bounds(by_name["draft"]) == (0, 0, 0)  # no draft worker at all
    elif env.get("SPECDEC_DRAFT_REPLICAS"):
        shared = int(env["SPECDEC_DRAFT_REPLICAS"])
        assert _bounds(by_name["draft"]) == (shared, shared, shared)
    else:  # one draft worker per target replica
        assert _bounds(by_name["draft"]) == (lowest, start, highest)


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
        scaled.append(_bounds(groups(cluster)["target"]))
    assert (2, 2, 8) in scaled, "the scale example sets 2..8 replicas"


def test_in_tree_autoscaling_is_on_and_keeps_idle_gpu_pods_a_while():
    spec = _raycluster()["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    options = spec["autoscalerOptions"]
    assert options["upscalingMode"] in ("Default", "Aggressive", "Conservative")
    # Longer than it takes to start a GPU pod and load a model again, so that load coming back a
    # minute later does not pay for that.
    assert options["idleTimeoutSeconds"] >= 120
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(options["resources"][kind])
    assert options["securityContext"]["allowPrivilegeEscalation"] is False


# What each specdec actor asks Ray for (specdec/app/ray_actors.py): the coordinator on the head,
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
    env = env_values(_ray_container(_groups()["head"]))
    assert env["SPECDEC_DRAFT_PLACEMENT"] in ("colocated", "spread")
    assert 0 < float(env["SPECDEC_KV_MEMORY_FRACTION"]) <= 1
    script = _script(_ray_container(_groups()["head"]))
    # `specdec serve` reads SPECDEC_* itself; a flag on the command line would override the env.
    for flag in ("--replicas", "--min-replicas", "--max-replicas", "--draft-placement"):
        assert flag not in script


# --- overlays ----------------------------------------------------------------------------------

_MISSING = object()


def _changed_paths(a, b, path: str = "") -> set[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return set().union(*(_changed_paths(a.get(k, _MISSING), b.get(k, _MISSING), f"{path}/{k}")
                             for k in a.keys() | b.keys()))
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return set().union(*(_changed_paths(x, y, f"{path}/{i}") for i, (x, y) in enumerate(zip(a, b))))
    return set() if a == b else {path}


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
            if (paths := _changed_paths(base.get(key, _MISSING), changed.get(key, _MISSING)))}
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
    assert _bounds(by_name["draft"]) == (0, 0, 0)
    assert _bounds(by_name["target"]) == _bounds(_groups()["target"])


def test_storage_class_overlay_names_a_class_for_the_rwx_volume():
    pvc = one(rendered("overlays/storage-class"), "PersistentVolumeClaim")
    assert pvc["spec"]["storageClassName"] and pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_next_cluster_serves_beside_the_first_behind_the_same_service_and_policies():
    """During an upgrade both RayClusters run: the Service reaches both heads, and each cluster's
    pods can talk Ray and worker gRPC among themselves as the first cluster's do."""
    first = _raycluster()
    (second,) = [d for d in rendered("overlays/next-cluster") if d["kind"] == "RayCluster"]
    assert second["metadata"]["name"] != first["metadata"]["name"]
    assert _changed_paths(first["spec"], second["spec"]) == set()
    selector = {"matchLabels": _one("Service")["spec"]["selector"]}
    for cluster in (first, second):
        assert _selector_matches(selector, _pod_labels("head", cluster))
        head = _pod_labels("head", cluster)
        for worker in ("target", "draft"):
            labels = _pod_labels(worker, cluster)
            assert _allowed(_worker_port(worker), labels, head)
            assert _allowed(int(first["spec"]["workerGroupSpecs"][0]["rayStartParams"]["node-manager-port"]),
                            labels, _pod_labels("draft" if worker == "target" else "target", cluster))
        assert _allowed(int(cluster["spec"]["headGroupSpec"]["rayStartParams"]["port"]), head,
                        _pod_labels("target", cluster))
        assert _selector_matches(_one("PodDisruptionBudget")["spec"]["selector"], _pod_labels("target", cluster))


def test_raycluster_groups_leave_kuberay_the_options_it_sets_itself():
    assert [g["groupName"] for g in _raycluster()["spec"]["workerGroupSpecs"]] == ["target", "draft"]
    for name, group in _groups().items():
        assert "block" not in group["rayStartParams"] and "address" not in group["rayStartParams"], name


# --- disruption budget and metrics -------------------------------------------------------------


def test_disruption_budget_lets_one_worker_pod_go_at_a_time_and_leaves_the_head_alone():
    pdb = _one("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    selector = pdb["spec"]["selector"]
    assert _selector_matches(selector, _pod_labels("target")) and _selector_matches(selector, _pod_labels("draft"))
    assert not _selector_matches(selector, _pod_labels("head"))


def test_podmonitor_scrapes_the_coordinator_with_the_token_and_ray_on_every_pod():
    docs = rendered("overlays/podmonitor")
    monitor = one(docs, "PodMonitor")
    cluster = one(docs, "RayCluster")
    endpoints = {e["port"]: e for e in monitor["spec"]["podMetricsEndpoints"]}
    assert set(endpoints) == {"http", "metrics"}
    for name, group in groups(cluster).items():
        labels = _pod_labels(name, cluster)
        assert _selector_matches(monitor["spec"]["selector"], labels), name
        ports = {p["name"]: p["containerPort"] for p in ray_container(group)["ports"]}
        assert ports["metrics"] == int(group["rayStartParams"]["metrics-export-port"]), name
        if name == "head":
            assert ports["http"] == HTTP_PORT  # the coordinator's /metrics
    credentials = endpoints["http"]["authorization"]["credentials"]
    assert endpoints["http"]["authorization"]["type"] == "Bearer"
    assert credentials["name"] == _secret()["metadata"]["name"] and credentials["key"] in _secret()["stringData"]
    assert all(e["path"] == "/metrics" for e in endpoints.values())


def test_podmonitor_overlay_lets_prometheus_reach_ray_metrics_from_its_namespace():
    docs = rendered("overlays/podmonitor")
    policy = one(docs, "NetworkPolicy", "specdec-metrics")
    cluster = one(docs, "RayCluster")
    ray_metrics = int(_groups()["head"]["rayStartParams"]["metrics-export-port"])
    for name in groups(cluster):
        assert _selector_matches(policy["spec"]["podSelector"], _pod_labels(name, cluster)), name
    (rule,) = policy["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [ray_metrics]
    (peer,) = rule["from"]
    assert set(peer) == {"namespaceSelector"}  # Prometheus' namespace, not everyone


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
        assert "nodeSelector" not in pod, "the base selects GPU nodes by the GPU request alone (overlays pin)"
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


def test_models_volume_is_read_only_everywhere_but_in_the_fetch_init_container():
    pvc = _one("PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # written on the head's node, read on others
    for name, group in _groups().items():
        pod = group["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        (mount,) = [m for m in _ray_container(group)["volumeMounts"] if m["mountPath"] == "/models"]
        assert mount["readOnly"] is True, name
        claim = volumes[mount["name"]]["persistentVolumeClaim"]
        assert claim["claimName"] == pvc["metadata"]["name"], name
        # Only the head pod writes (its init container); on workers even the claim is read-only.
        assert claim.get("readOnly", False) is (name != "head"), name
        for init in pod.get("initContainers", []):
            assert name == "head" and init["name"] == "fetch-models", (name, init["name"])
            (init_mount,) = [m for m in init["volumeMounts"] if m["name"] == mount["name"]]
            assert init_mount["mountPath"] == "/models" and not init_mount.get("readOnly", False)
    env = _env(_ray_container(_groups()["head"]))
    assert env["SPECDEC_TARGET"]["value"].startswith("/models/")


def test_auth_token_comes_from_the_secret():
    secret = _secret()
    env = _env(_ray_container(_groups()["head"]))
    ref = env["SPECDEC_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"]
    assert ref["key"] in secret["stringData"]
    assert not ref.get("optional", False)


# --- probes, ports, network policy, service ----------------------------------------------------


def _probe_window_s(probe: dict) -> int:
    """How long a failing probe takes to act: the kubelet's defaults where a field is unset."""
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def test_startup_and_readiness_are_grpc_health_checks_on_the_public_port():
    container = _ray_container(_groups()["head"])
    for probe in ("startupProbe", "readinessProbe"):
        spec = container[probe]
        assert set(spec) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"grpc"}, probe
        assert spec["grpc"]["port"] == PUBLIC_PORT, probe
    assert container["readinessProbe"]["grpc"]["service"] == "specdec.v1.Generation"
    assert container["startupProbe"]["grpc"].get("service", "") == ""
    assert any(p["containerPort"] == PUBLIC_PORT and p["name"] == "grpc" for p in container["ports"])


def test_startup_probe_outlasts_the_wait_for_worker_pods_plus_model_loading():
    container = _ray_container(_groups()["head"])
    worker_wait = float(env_values(container)["SPECDEC_WORKER_WAIT"])
    # The autoscaler may first have to get a GPU node (the wait), then both models load: allow at
    # least 10 minutes for loading on top.
    assert _probe_window_s(container["startupProbe"]) >= worker_wait + 600


def test_liveness_asks_ray_not_specdec_so_a_loading_head_is_not_killed():
    head = _groups()["head"]
    container = _ray_container(head)
    liveness = container["livenessProbe"]
    # Not the gRPC health of :50051: that is down while `specdec serve` (re)loads models and
    # NOT_SERVING while replicas are down, and killing the head restarts the whole Ray cluster.
    assert set(liveness) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"httpGet"}
    assert liveness["httpGet"]["path"] == "/api/gcs_healthz"
    assert liveness["httpGet"]["port"] == int(head["rayStartParams"]["dashboard-port"])
    assert any(p["containerPort"] == liveness["httpGet"]["port"] for p in container["ports"])
    assert _probe_window_s(liveness) >= 60, "one slow GCS answer must not restart the cluster"


def test_termination_grace_outlasts_drain_plus_stop():
    head = _groups()["head"]
    container = _ray_container(head)
    env = env_values(container)
    script = _script(container)
    # The numbers the head command actually uses for each stage of stopping.
    assert '--grace-period "$SPECDEC_GRACE_PERIOD"' in script
    assert 'sleep "$SPECDEC_GRACE_PERIOD"; sleep "$SPECDEC_STOP_SECONDS"' in script
    assert 'timeout "$SPECDEC_RAY_STOP_SECONDS" ray stop' in script
    stopping = sum(float(env[v]) for v in ("SPECDEC_GRACE_PERIOD", "SPECDEC_STOP_SECONDS",
                                           "SPECDEC_RAY_STOP_SECONDS"))
    assert head["template"]["spec"]["terminationGracePeriodSeconds"] > stopping
    assert float(env["SPECDEC_GRACE_PERIOD"]) > 0 and float(env["SPECDEC_STOP_SECONDS"]) > 0


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
    for group in _groups().values():
        assert group["template"]["spec"]["securityContext"]["runAsUser"] == int(user)


def test_dockerignore_keeps_the_venv_and_git_out_of_the_build_context():
    lines = [x.strip() for x in (REPO / ".dockerignore").read_text().splitlines()
             if x.strip() and not x.startswith("#")]
    assert lines[0] == "*"  # allow-list
    assert not any(x.startswith("!") and (".venv" in x or ".git" in x) for x in lines)
    for needed in ("pyproject.toml", "specdec/", "coordinator/", "draft_worker/", "target_worker/"):
        assert f"!{needed}" in lines
