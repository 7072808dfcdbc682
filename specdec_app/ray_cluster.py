"""The Ray cluster as specdec's actors see it: the namespace and custom resources they use, whether
the cluster still answers, waiting on it without outliving it, and the addresses workers bind.

- Custom resources are requested only when the cluster has them: the coordinator asks for
  `specdec_coordinator` (only the KubeRay head has it), the workers for `specdec_target` /
  `specdec_draft` (one per worker pod); see k8s/README.md, "What the actor code must match".
- Workers that bind a non-loopback address (`node-ip`) use fixed ports, as the NetworkPolicy
  opens only those: the settings target_worker_port and draft_worker_port (env
  SPECDEC_TARGET_WORKER_PORT / SPECDEC_DRAFT_WORKER_PORT). On loopback a free port is picked.
"""
from __future__ import annotations

import os
import socket
import threading
import time

import ray

from specdec.addresses import host_port, is_loopback
from specdec.config import REPO_ROOT

NAMESPACE = "specdec"
COORDINATOR_RESOURCE = "specdec_coordinator"
TARGET_RESOURCE = "specdec_target"
DRAFT_RESOURCE = "specdec_draft"


def ray_is_up(timeout_s: float = 0.5) -> bool:
    """Does this driver's Ray cluster still answer? Asked before calls on the shutdown path, since
    Ray's own client waits 15-60 s on a GCS that is gone. False at once when a GCS or raylet that
    this process started has exited; else one GCS request (Ray waits about a second at least for
    an answer: a GCS told SIGTERM stops answering at once but its process lingers for seconds).
    False when not connected."""
    if not ray.is_initialized():
        return False
    node = getattr(ray._private.worker, "_global_node", None)
    owned = getattr(node, "all_processes", None) or {}
    if any(info.process.poll() is not None for kind in ("gcs_server", "raylet") for info in owned.get(kind, [])):
        return False
    try:
        gcs = ray._private.worker.global_worker.gcs_client
        gcs.internal_kv_get(b"specdec-probe", None, timeout=timeout_s)
        return True
    except AttributeError:  # (another Ray version's client) its GCS port accepts a connection
        host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return True
        except (OSError, ValueError):
            return False
    except Exception:  # noqa: BLE001 - ray.exceptions.RpcError and kin: no answer
        return False


def get_while_up(refs, timeout_s: float, poll_s: float = 0.5, stop: threading.Event | None = None):
    """ray.get(refs) for up to timeout_s, giving up as soon as Ray itself is gone or `stop` is set
    (TimeoutError each way): a call on the shutdown path must not outlive the cluster it waits on,
    nor a caller's wait the work it was for."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs) if isinstance(refs, list) else [refs]
    while True:
        left = deadline - time.monotonic()
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=max(min(poll_s, left), 0.0))
        if not pending:
            return ray.get(refs, timeout=poll_s)
        if left <= poll_s:
            raise TimeoutError(f"no answer within {timeout_s:g}s")
        if stop is not None and stop.is_set():
            raise TimeoutError("stopped")
        if not ray_is_up():
            raise TimeoutError("Ray is gone")


def checkout_env() -> dict:
    """Environment variables for the actors of a Ray instance this process starts: PYTHONPATH with
    this checkout first, so that they import this specdec whatever directory Ray runs them in."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}


def specdec_resources() -> dict:
    """The specdec_* custom resources of the connected Ray cluster (name -> total)."""
    return {k: v for k, v in ray.cluster_resources().items() if k.startswith("specdec_")}


def wait_for_resources(names: list[str], timeout_s: float, on_wait=None, poll_s: float = 2.0, stop=None) -> None:
    """Wait until the cluster has every custom resource in `names` (the worker nodes joined).

    `on_wait(missing)` is called once if they are not there yet; a set `stop` (threading.Event)
    ends the wait early. TimeoutError names what is missing."""
    deadline = time.monotonic() + timeout_s
    told = False
    while True:
        have = ray.cluster_resources()
        missing = [n for n in names if have.get(n, 0) < 1]
        if not missing:
            return
        if not told and on_wait is not None:
            on_wait(missing)
            told = True
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"no Ray node with resource {', '.join(missing)} joined within {timeout_s:.0f}s: are the "
                f"{'/'.join(n.removeprefix('specdec_') for n in missing)} worker pods running and joined to the "
                "cluster? (`ray status` lists the nodes and their resources)")
        if stop is not None:
            if stop.wait(poll_s):
                return
        else:
            time.sleep(poll_s)


# --- addresses --------------------------------------------------------------------------------


def resolve_host(host: str) -> str:
    """"node-ip" -> this Ray node's IP; anything else unchanged."""
    if host in ("node-ip", "node_ip"):
        return ray.util.get_node_ip_address()
    return host


def advertised(host: str, port: int) -> str:
    """The host:port other processes should dial for a server bound on host:port."""
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    return host_port(host, port)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on this machine right now (small race until the server binds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


def worker_port(host: str, fixed_port: int) -> int:
    """The port a worker binds: a free one on loopback, else the fixed one the NetworkPolicy opens."""
    return free_port(host) if is_loopback(host) else fixed_port
