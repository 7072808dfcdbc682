"""What the pods of k8s/ run: every Ray container's script (valid bash that starts Ray), the head's
command run with stub `ray` / `specdec` programs (starts Ray, then `specdec serve`; restarts serve
but not Ray; fails the container when Ray dies; drains on SIGTERM and kills a serve that overruns
its grace period), and the init container that fills the model volume, run with a stub
huggingface_hub.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k8s_base import HTTP_PORT, PUBLIC_PORT, base_groups, base_raycluster, env_of, needs_bash, script_of
from k8s_render import BASE, env_values, groups, one, ray_container, rendered

# --- what the pods run -------------------------------------------------------------------------


def test_kuberay_command_overwrite_and_every_ray_container_starts_ray():
    assert base_raycluster()["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    for name, group in base_groups().items():
        script = script_of(ray_container(group))
        # The inner bash keeps the quoted --resources JSON in one argument.
        assert 'bash -c "$KUBERAY_GEN_RAY_START_CMD"' in script, name
        assert "ulimit -n 65536" in script, name


@needs_bash
@pytest.mark.parametrize("group_name", ["head", "target", "draft"])
def test_container_scripts_are_valid_bash(group_name):
    script = script_of(ray_container(base_groups()[group_name]))
    result = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, result.stderr


def test_head_runs_specdec_serve_on_the_public_port():
    script = script_of(ray_container(base_groups()["head"]))
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
    container = ray_container(base_groups()["head"])
    env = {k: e["value"] for k, e in env_of(container).items() if "value" in e}
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

def _head_stop_handler() -> str:
    """The head script's on_stop function, as written in the manifest."""
    script = script_of(ray_container(base_groups()["head"]))
    lines = script[script.index("on_stop() {"):].splitlines()
    return "\n".join(lines[:lines.index("}") + 1])


@needs_bash
def test_head_stop_handler_leaves_the_restart_wait_alone_and_reaches_a_serve_started_meanwhile():
    """A trap runs between any two commands, so SIGTERM may land between `sleep DELAY &` and
    `wait $!`, or between forking a new serve and `serve_pid=$!`. Run on_stop exactly there: it
    must not change $! (a timer job would leave the loop waiting for the whole grace period), and
    the serve started meanwhile must get SIGTERM from the script's re-check."""
    script = script_of(ray_container(base_groups()["head"]))
    assert 'serve_pid=$!\n' in script
    recheck = script[script.index("serve_pid=$!\n"):].splitlines()[1:3]
    assert any(x.strip() == '[ -n "$stopping" ] && on_stop' for x in recheck), recheck
    harness = (f"SPECDEC_GRACE_PERIOD=0.2; SPECDEC_STOP_SECONDS=0.2; stopped_pid=''\n"
               f"{_head_stop_handler()}\n"
               "sleep 0 & serve_pid=$!; wait $serve_pid        # a serve that has exited\n"
               "sleep 30 & delay_pid=$!                      # the restart delay\n"
               "on_stop                                       # SIGTERM lands here\n"
               '[ "$!" = "$delay_pid" ] && echo "restart wait kept"\n'
               "kill $delay_pid; wait $delay_pid\n"
               "sleep 30 & serve_pid=$!                      # a serve forked meanwhile\n"
               '[ -n "$stopping" ] && on_stop                 # the re-check\n'
               '[ -n "$stopping" ] && on_stop                 # once is enough\n'
               'wait $serve_pid; echo "serve status $?"\n')
    result = subprocess.run(["bash", "-c", harness], capture_output=True, text=True, timeout=20,
                            start_new_session=True)
    assert result.stdout.splitlines() == ["restart wait kept", f"serve status {128 + signal.SIGTERM}"], (
        result.stdout, result.stderr)


@needs_bash
def test_head_wait_loop_leaves_when_the_serve_exits_right_after_its_liveness_test():
    """The serve may exit, and bash reap it, between the loop's `kill -0` and the wait that
    follows (a SIGTERM's trap runs there too, and kills it). Run the loop exactly there (`kill -0`
    answers once that the exited serve is alive): it must leave within a poll, not wait for Ray
    (`wait -n "$serve_pid" "$ray_pid"`, the loop before, no longer knew the serve as a job and
    waited for Ray alone; 2 of 25 runs of the head script's test under load hung so)."""
    script = script_of(ray_container(base_groups()["head"]))
    lines = script[script.index('while kill -0 "$serve_pid"'):].splitlines()
    wait_loop = "\n".join(lines[:next(i for i, x in enumerate(lines) if x.strip() == "done") + 1])
    harness = ("sleep 0 & serve_pid=$!; wait $serve_pid        # a serve that has exited, reaped\n"
               "sleep 30 & ray_pid=$!\n"
               "alive_once=1\n"
               'kill() { if [ "$1 $2" = "-0 $serve_pid" ] && [ -n "$alive_once" ]; then alive_once=""; return 0; fi\n'
               '         command kill "$@"; }\n'
               f"{wait_loop}\n"
               'echo "loop left"; command kill $ray_pid\n')
    # Ray's stub lives 30 s: a loop that waits for it runs past the timeout (TimeoutExpired).
    result = subprocess.run(["bash", "-c", harness], capture_output=True, text=True, timeout=20,
                            start_new_session=True)
    assert result.stdout.splitlines() == ["loop left"], (result.stdout, result.stderr)

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
