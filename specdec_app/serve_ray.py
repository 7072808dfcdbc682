"""`specdec serve` on Ray: start a local Ray instance that listens on loopback only (or join a
cluster), wait for a cluster's worker nodes and decide how many GPUs each worker gets, launch the
deployment (specdec_app.ray_actors), serve until a signal, drain, and leave Ray, without waiting
on a Ray whose processes are already gone.

Importing this module imports Ray; `specdec serve --no-ray` never does.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback

import ray

from specdec.config import ServiceConfig
from specdec_app.ray_actors import launch
from specdec_app.ray_cluster import (
    DRAFT_RESOURCE,
    NAMESPACE,
    TARGET_RESOURCE,
    checkout_env,
    ray_is_up,
    specdec_resources,
    wait_for_resources,
)
from specdec_app.serve_messages import ServeError, describe, http_note, kv_summary, print_error, say
from specdec_app.serve_signals import DrainSignals

# Ray binds its ports (GCS, raylet, object manager, workers, dashboard agent, metrics export) to
# its node IP, and on Linux turns a node IP of 127.0.0.1 into the machine's address unless its
# cluster mode is off. With this variable at 0 (read when `ray` is imported, inherited by the
# processes it starts) a local instance keeps everything on loopback; no other node can join it.
_RAY_LOOPBACK_ENV = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def _keep_local_ray_on_loopback() -> None:
    name, value = _RAY_LOOPBACK_ENV
    os.environ[name] = value  # for the processes Ray starts
    # This process imported ray with the module: the constant it read then is stale (Ray reads it
    # as ray_constants.ENABLE_RAY_CLUSTER at each use, so setting it here is enough).
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False


def _ray_init(config: ServiceConfig, quiet: bool):
    """Join config.ray.address, or start a local Ray instance that listens on loopback only (its
    dashboard on config.ray.dashboard_host, 127.0.0.1 unless told otherwise)."""
    started = config.ray.address is None
    if started:
        _keep_local_ray_on_loopback()
    kwargs = dict(namespace=NAMESPACE, logging_level="WARNING" if quiet else "INFO")
    if started:
        env = {**checkout_env(), _RAY_LOOPBACK_ENV[0]: _RAY_LOOPBACK_ENV[1]}
        # address="local": a new instance even where another one runs on this machine (without
        # it, ray.init() joins a cluster that `ray start` or a test left here).
        context = ray.init(address="local", include_dashboard=True, dashboard_host=config.ray.dashboard_host,
                           dashboard_port=config.ray.dashboard_port, num_cpus=max(os.cpu_count() or 1, 2),
                           runtime_env={"env_vars": env}, _node_ip_address="127.0.0.1", **kwargs)
    else:
        context = ray.init(address=config.ray.address, **kwargs)
    url = getattr(context, "dashboard_url", None) or ""
    if url and not url.startswith("http"):
        url = f"http://{url}"
    info = getattr(context, "address_info", None) or {}
    metrics_port = info.get("metrics_export_port")
    metrics = f"http://{info.get('node_ip_address', '127.0.0.1')}:{metrics_port}/metrics" if metrics_port else ""
    return ray, started, url, metrics


def _plan_gpus(ray, config: ServiceConfig, started: bool, stop=None) -> float | None:
    """GPUs per worker actor (None: one each), after waiting for the worker nodes of a cluster.

    A cluster laid out for specdec (custom resources specdec_*, as in k8s/base/raycluster.yaml) gets
    its worker nodes waited for (worker_wait) and one GPU per worker. Otherwise two GPU workers
    on a single machine with one GPU share it (0.5 each) rather than wait forever; on a multi-node
    cluster they are never made to share, since more GPU nodes may still be joining."""
    draft_model = config.draft.kind == "model"
    if not started and specdec_resources():
        needed = [TARGET_RESOURCE] + ([DRAFT_RESOURCE] if draft_model else [])

        def tell(missing: list[str]) -> None:
            say(f"specdec: waiting up to {config.ray.worker_wait:g}s for Ray worker nodes with "
                 f"{', '.join(missing)} to join (`ray status` shows the nodes)")

        try:
            wait_for_resources(needed, config.ray.worker_wait, tell, stop=stop)
        except TimeoutError as e:
            raise ServeError(str(e)) from None
        return None
    if not (config.target.device.startswith("cuda") and draft_model):
        return None
    have = ray.cluster_resources().get("GPU", 0)
    single_node = sum(1 for n in ray.nodes() if n.get("Alive")) == 1
    if 0 < have < 2 and (started or single_node):
        return have / 2
    return None


def serve_with_ray(config: ServiceConfig, quiet: bool, signals: DrainSignals) -> int:
    """Serve `config` on Ray until a signal; the exit status."""
    t0 = time.perf_counter()
    ray, started, dashboard, metrics_url = _ray_init(config, quiet)
    signals.install()
    try:
        status = _serve_deployment(config, signals, started, t0, dashboard, metrics_url)
    except BaseException as error:
        _leave_ray(ray, error)
        raise
    _leave_ray(ray)
    return status


def _serve_deployment(config: ServiceConfig, signals: DrainSignals, started: bool, t0: float, dashboard: str,
                      metrics_url: str) -> int:
    """Launch the actors, serve until a signal, drain; the exit status."""
    if signals.stop.is_set():
        return 0
    if config.ray.worker_host is None:
        config = ServiceConfig.from_settings(config, worker_host="127.0.0.1" if started else "node-ip")
    gpus = _plan_gpus(ray, config, started, signals.stop)
    if signals.stop.is_set():
        return 0
    try:
        deployment = launch(config, target_gpus=gpus, draft_gpus=gpus)
    except (RuntimeError, ValueError) as e:
        raise ServeError(f"could not start the service: {e}") from e
    if signals.stop.is_set():
        deployment.drain_and_stop(0)
        return 0
    where = f"{config.server.host}:{deployment.port} (gRPC){http_note(config, deployment.http_port)}"
    extra = f"; dashboard at {dashboard}" if dashboard else ""
    say(f"specdec serving {describe(config)} on {where}{extra} "
         f"(ready in {time.perf_counter() - t0:.1f}s; workers: target {deployment.target_address}"
         f"{', draft ' + deployment.draft_address if deployment.draft_address else ''})")
    say(kv_summary(deployment.replicas[0].info["info"], config.replicas.count))
    if metrics_url:
        say(f"specdec metrics (Prometheus, ray_specdec_*) at {metrics_url}")
    signals.wait()
    if not ray_is_up():
        say(f"specdec: {signals.received}, but Ray's processes are gone (stopped first): nothing to drain")
        return 0
    grace = config.server.grace_period
    say(f"specdec: {signals.received}, draining (grace {grace:g}s)")
    snapshot = deployment.drain_and_stop(grace)
    if snapshot:
        rate = snapshot.get("acceptance_rate")
        say(f"specdec: stopped after {snapshot.get('rounds', 0)} rounds, {snapshot.get('generated_tokens', 0)} "
             f"tokens" + (f", acceptance rate {rate:.3f}" if rate is not None else ""))
    else:
        say("specdec: stopped")
    return 0


def _leave_ray(ray, error: BaseException | None = None) -> None:
    """ray.shutdown(): stops the local instance if this command started it, else disconnects.

    With Ray's GCS gone, ray.shutdown() (and the one Ray's atexit hook runs) waits 15-60 s for it:
    then the local processes that remain are killed and the process exits here, with its output
    flushed and the status it would have had (`error`: the exception on its way out)."""
    if ray_is_up():
        ray.shutdown()
        return
    node = getattr(ray._private.worker, "_global_node", None)
    with contextlib.suppress(Exception):  # best effort: what is left dies with its parent anyway
        if node is not None:
            node.kill_all_processes(check_alive=False, allow_graceful=False)
    status = 0
    if isinstance(error, ServeError):
        print_error(error)
        status = 2
    elif error is not None:
        traceback.print_exception(error)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
