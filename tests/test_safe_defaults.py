"""Safe by default: `specdec serve` listens on loopback unless told otherwise, says loudly when it
is exposed without a token or TLS, and the local Ray instance it starts keeps every port on
loopback."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from coordinator.frontend.server_thread import LOOPBACK_SERVER, run_server_in_thread
from specdec.config import ServerConfig, ServiceConfig, is_loopback
from specdec_app import serve
from specdec_app.embedded import LocalSchedulerFactory

from checkpoints import CONFIGS, build_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def test_serve_binds_loopback_unless_told_otherwise():
    assert ServiceConfig().server.host == "127.0.0.1"
    parser = serve.argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert serve.build_config(parser.parse_args([])).server.host == "127.0.0.1"
    assert serve.build_config(parser.parse_args(["--host", "0.0.0.0"])).server.host == "0.0.0.0"


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                           ("[::1]", True), ("127.0.0.2", True), ("0.0.0.0", False),
                                           ("::", False), ("10.1.2.3", False), ("specdec.example", False)])
def test_what_counts_as_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_exposure_warnings_name_what_is_missing():
    assert ServerConfig().exposure_warnings() == []
    assert ServerConfig(host="::1").exposure_warnings() == []
    bare = ServerConfig(host="0.0.0.0").exposure_warnings()
    assert len(bare) == 2 and "no auth_token" in bare[0] and "without TLS" in bare[1]
    (no_tls,) = ServerConfig(host="0.0.0.0", auth_token="t").exposure_warnings()
    assert "clear text" in no_tls
    assert ServerConfig(host="0.0.0.0", auth_token="t", tls_cert="c", tls_key="k").exposure_warnings() == []


def test_exposed_serve_warns_before_it_binds(tmp_path):
    """The banner comes first: here the port is taken, so serve stops right after it."""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("SPECDEC_AUTH_TOKEN", None)
        proc = subprocess.run([sys.executable, "-m", "specdec_app.cli", "serve", "--no-ray", "--host", "0.0.0.0",
                               "--port", str(port)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    warning_at = proc.stderr.index("WARNING: this server is reachable from other machines")
    assert "no auth_token" in proc.stderr and "without TLS" in proc.stderr
    assert warning_at < proc.stderr.index("error:"), proc.stderr


def test_health_shows_the_exposure_warnings(models_for_safety):
    factory = models_for_safety
    config = ServerConfig(host="0.0.0.0", port=0, http_port=-1, grace_period=1.0)
    with run_server_in_thread(factory, factory.tokenizer, config) as server:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/health", timeout=10) as response:
            body = json.load(response)
    assert body["status"] == "ok" and len(body["warnings"]) == 2
    with run_server_in_thread(factory, factory.tokenizer, LOOPBACK_SERVER) as server:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/health", timeout=10) as response:
            assert "warnings" not in json.load(response)


@pytest.fixture
def models_for_safety(tmp_path):
    target = build_checkpoint(tmp_path / "target", seed=0, **CONFIGS["gqa_untied"])
    return LocalSchedulerFactory(ServiceConfig.from_settings(target=str(target), draft=None))


_LISTENERS = textwrap.dedent("""
    import json, os, sys
    import ray
    from specdec_app.serve_ray import _ray_init
    from specdec.config import ServiceConfig

    _ray_init(ServiceConfig(), quiet=True)

    @ray.remote
    class Probe:
        def pid(self):
            return os.getpid()

    probe = Probe.remote()
    ray.get(probe.pid.remote(), timeout=60)

    def children(pid):
        out = set()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = open(f"/proc/{entry}/stat").read()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    out.add(int(entry))
        return out

    family, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        if pid not in family:
            family.add(pid)
            todo += children(pid)
    inodes = {}
    for pid in family:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            pass
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN, one of ours
                address, port = fields[1].split(":")
                listening.append([address, int(port, 16)])
    ray.shutdown()
    print(json.dumps(listening))
""")

# /proc/net/tcp{,6} addresses: 127.0.0.1, and ::ffff:127.0.0.1 / ::1 in IPv6.
_LOOPBACK_HEX = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")
@pytest.mark.timeout(180)
def test_the_local_ray_instance_serve_starts_listens_on_loopback_only():
    pytest.importorskip("ray")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", _LISTENERS], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    listening = json.loads(proc.stdout.strip().splitlines()[-1])
    # GCS, raylet, object manager, dashboard, its agents, the actor's worker...: all on loopback.
    assert len(listening) >= 5, listening
    exposed = [(address, port) for address, port in listening if address not in _LOOPBACK_HEX]
    assert exposed == [], f"Ray ports open beyond loopback: {exposed}"
