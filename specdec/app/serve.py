"""`specdec serve`: start the service.

With no arguments: start a local Ray instance (dashboard on http://127.0.0.1:8265), put the
shipped pair (models/target drafted by models/draft) in Ray actors, and serve Generate (gRPC) on
127.0.0.1:50051 and the OpenAI-compatible HTTP API on 127.0.0.1:8000 (--http-port; 0: off).
Everything listens on loopback by default: the public ports (--host 0.0.0.0 opens them, and then
a missing --auth-token or TLS is warned about at start-up and on /health), the workers, and the
local Ray instance this command starts (see _ray_init).

  specdec serve                                   # shipped pair, local Ray, 127.0.0.1:50051
  specdec serve --host 0.0.0.0 --auth-token "$TOKEN" --tls-cert crt.pem --tls-key key.pem
  specdec serve --target DIR --draft ngram        # n-gram (prompt lookup) drafting
  specdec serve --target model.gguf               # a GGUF file (quantized weights are dequantized)
  specdec serve --target Qwen/Qwen2.5-0.5B-Instruct --draft ngram   # from the local Hub cache
  specdec serve --ray-address auto --worker-host node-ip   # join a running cluster
  specdec serve --no-ray                          # one process, no Ray (development, tests)
  specdec serve --no-ray --http-port 8000 --api-key s3cret   # OpenAI clients: base_url http://host:8000/v1

Every setting is also read from its SPECDEC_* environment variable (named in each flag's help);
a flag beats the environment, the environment beats the default.

SIGTERM / SIGINT drain: the server refuses new requests (UNAVAILABLE), in-flight requests run to
completion for up to --grace-period seconds, then the actors stop, Ray shuts down if this command
started it, and the exit status is 0, within the grace period + 5 s. A second signal exits at once
(status 1). A signal to the command's whole process group (systemd's default KillMode, a
supervisor) drains the same way: the Ray instance this command starts runs in a session of its
own, which only the command signals (_in_own_session). If Ray's processes were stopped first,
nothing is left to drain: the command exits 0 at once instead of waiting on a Ray that is gone.

On a cluster whose nodes carry specdec_* resources (k8s/base/raycluster.yaml) the command first waits
for the target/draft worker nodes (--worker-wait), and each actor goes to its own node. A worker
whose process dies (or hangs past --worker-round-timeout) is restarted by Ray (--max-restarts) on
the same port, and the coordinator resumes its in-flight requests where they were: the clients
see a pause. Once Ray has no restarts left, those requests fail with UNAVAILABLE and health says
NOT_SERVING.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from specdec.app.flags import SERVE_SETTINGS, add_settings, all_serve_settings, given_settings
from specdec.config import REPO_ROOT, SHIPPED_DRAFT, SHIPPED_TARGET, ConfigError, ServiceConfig, host_port

DRAFT_DEFAULT_NOTE = "models/draft with the shipped target, else none"


class ServeError(Exception):
    """A problem the user can fix (bad path, port in use): printed without a traceback."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__.split("\n\n", 1)[1]
    for title, names in SERVE_SETTINGS.items():
        add_settings(parser.add_argument_group(title), names, {"draft": DRAFT_DEFAULT_NOTE})
    parser.add_argument("--quiet", action="store_true", help="less Ray logging")


# --- argument checks --------------------------------------------------------------------------


def _check_model(spec: str, what: str) -> str:
    """Resolve a model spec (directory, .gguf file or Hub id) and read its config, so that a bad
    spec or an unsupported model fails here, before Ray starts. Returns the spec to pass on: a
    path made absolute, a Hub id as given (each worker resolves it from its own cache)."""
    from specdec.model.config import ModelConfig
    from specdec.model.source import ModelSourceError, resolve_model_source

    try:
        source = resolve_model_source(spec)
        ModelConfig.from_dict(source.config)
    except ModelSourceError as e:
        hint = ""
        if Path(spec).expanduser().resolve() in (SHIPPED_TARGET.resolve(), SHIPPED_DRAFT.resolve()):
            hint = " (the shipped models are built by scripts/ in this repository; or pass --target/--draft)"
        raise ServeError(f"{what} model: {e}{hint}") from None
    except (ValueError, OSError, KeyError) as e:
        raise ServeError(f"{what} model {spec}: {e}") from None
    return spec if source.hub_id else str(source.path.resolve())


def build_config(args) -> ServiceConfig:
    """The service's one config: flags, then SPECDEC_* variables, then the defaults; the draft
    defaults to the shipped draft only when the target is the shipped target."""
    given = given_settings(args, all_serve_settings())
    if "draft" not in given:
        given["draft"] = str(SHIPPED_DRAFT) if "target" not in given else None
    try:
        config = ServiceConfig.from_settings(**given)
    except ConfigError as e:
        raise ServeError(str(e)) from None
    target = _check_model(config.target.model, "target")
    draft = config.draft.model
    if config.draft.kind == "model":
        draft = _check_model(draft, "draft")
    if config.server.tls_cert:
        for path in (config.server.tls_cert, config.server.tls_key):
            if not Path(path).is_file():
                raise ServeError(f"TLS file {path} does not exist")
    return ServiceConfig.from_settings(config, target=target, draft=draft)


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """Fail early and clearly (before Ray starts) if a public port is taken."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host.strip("[]"), port))
        except PermissionError:
            raise ServeError(f"no permission to bind {host}:{port}: choose a port above 1023 with {flag}") from None
        except OSError as e:
            raise ServeError(f"port {port} on {host} is in use ({e.strerror}): is another specdec serve "
                             f"running? Choose another with {flag}") from None


# --- signals ---------------------------------------------------------------------------------


class _Signals:
    """First SIGTERM/SIGINT: set `stop` (drain). Second: exit at once with status 1."""

    def __init__(self):
        self.stop = threading.Event()
        self.received: str | None = None
        self.install()

    def install(self) -> None:
        """(Re)install the handlers: ray.init replaces the SIGTERM handler with its own."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.stop.is_set():
            print("specdec: second signal, exiting without draining", file=sys.stderr, flush=True)
            os._exit(1)
        self.received = signal.Signals(signum).name
        self.stop.set()

    def wait(self) -> None:
        # Event.wait with a timeout lets the main thread run the Python signal handler promptly.
        while not self.stop.wait(0.5):
            pass


def _in_own_session(serve) -> int:
    """Run `serve()` in a forked child that leads a session of its own, and relay SIGTERM / SIGINT
    to it; returns its exit status.

    Ray starts its processes (GCS, raylet, dashboard) in the caller's process group, and they die
    at once on SIGTERM: a signal to the whole group killed the actors holding the in-flight
    streams, and the drain then blocked on Ray's 60 s reconnect to a GCS that was gone. In the
    child's own session only this command signals them. The child is told SIGTERM if this process
    dies first (PR_SET_PDEATHSIG), so it never outlives the command. Without fork (not POSIX),
    or where threads already run (fork would copy their locks), serve() runs here as before."""
    if not hasattr(os, "fork") or threading.active_count() > 1:
        return serve()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child, measured through the serve tests
        status = 1
        try:
            os.setsid()
            _die_with_parent()
            status = serve()
        except ServeError as e:
            print(f"specdec serve: error: {e}", file=sys.stderr, flush=True)
            status = 2
        except BaseException:  # noqa: BLE001 - report it; the child must not return into the CLI
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)

    def relay(signum, _frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, relay)
    _, status = os.waitpid(child, 0)  # (retried after each relayed signal: PEP 475)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code  # killed by signal n: the shell's 128 + n


def _die_with_parent() -> None:
    """SIGTERM to this process when its parent exits (Linux; elsewhere nothing)."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl: nobody would signal us
        os.kill(os.getpid(), signal.SIGTERM)


def _say(message: str) -> None:
    print(message, flush=True)


def _warn_exposure(config: ServiceConfig) -> None:
    """Before anything is bound: say loudly what is unsafe about where we are about to listen."""
    warnings = config.server.exposure_warnings()
    if not warnings:
        return
    bar = "!" * 100
    lines = [bar, "specdec serve: WARNING: this server is reachable from other machines and not protected:"]
    lines += [f"  - {warning}" for warning in warnings]
    lines += ["  (serve on 127.0.0.1, the default, to keep it to this machine)", bar]
    print("\n".join(lines), file=sys.stderr, flush=True)


def _http_note(config: ServiceConfig, http_port: int | None) -> str:
    """", OpenAI-compatible HTTP API at http://host:port/v1" when it is on."""
    if not http_port:
        return ""
    scheme = "https" if config.server.tls_cert else "http"
    return f", OpenAI-compatible HTTP API at {scheme}://{host_port(config.server.host, http_port)}/v1"


def _describe(config: ServiceConfig) -> str:
    return (f"{config.target.model} (+draft {config.draft.model})" if config.draft.model
            else f"{config.target.model} (no draft)")


# --- the two ways to serve ---------------------------------------------------------------------


def kv_summary(target_info, replicas: int) -> str:
    """The start-up line on KV-cache capacity (TargetInfo, or its dict from a worker actor)."""
    info = target_info if isinstance(target_info, dict) else dataclasses.asdict(target_info)
    blocks, size = info["kv_blocks_total"], info["kv_block_size"]
    each = " each" if replicas > 1 else ""
    return (f"specdec KV cache: {blocks} blocks of {size} tokens{each}, at most {blocks * size} tokens of "
            f"concurrent context per target replica ({replicas} replica{'s' if replicas > 1 else ''})")


def _serve_in_process(config: ServiceConfig, signals: _Signals) -> int:
    from coordinator.metrics import RoundMetrics
    from coordinator.server import GenerationServer
    from coordinator.server_thread import ServerThread
    from specdec.app.embedded import LocalReplicaLauncher, LocalSchedulerFactory

    factories = [LocalSchedulerFactory(config) for _ in range(config.replicas.count)]
    server = GenerationServer(factories, factories[0].tokenizer, config.server, RoundMetrics(config.ray.name),
                              launcher=LocalReplicaLauncher(config), replica_config=config.replicas)
    handle = ServerThread(server)
    try:
        port = handle.start(wait_ready=True)
    except Exception as e:  # noqa: BLE001
        handle.stop(0)
        raise ServeError(f"could not start: {e}") from e
    http = _http_note(config, handle.http_port)
    _say(f"specdec serving {_describe(config)} on {config.server.host}:{port} (gRPC){http} (in-process, no Ray)")
    _say(kv_summary(factories[0].target_worker.info(), config.replicas.count))
    signals.wait()
    _say(f"specdec: {signals.received}, draining (grace {config.server.grace_period:g}s)")
    handle.stop()
    _say("specdec: stopped")
    return 0


# Ray binds its ports (GCS, raylet, object manager, workers, dashboard agent, metrics export) to
# its node IP, and on Linux turns a node IP of 127.0.0.1 into the machine's address unless its
# cluster mode is off. With this variable at 0 (read when `ray` is imported, inherited by the
# processes it starts) a local instance keeps everything on loopback; no other node can join it.
_RAY_LOOPBACK_ENV = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def _keep_local_ray_on_loopback() -> None:
    name, value = _RAY_LOOPBACK_ENV
    os.environ[name] = value
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # ray was imported already (e.g. in tests): its constant is stale
        constants.ENABLE_RAY_CLUSTER = False


def _ray_init(config: ServiceConfig, quiet: bool):
    """Join config.ray.address, or start a local Ray instance that listens on loopback only (its
    dashboard on config.ray.dashboard_host, 127.0.0.1 unless told otherwise)."""
    started = config.ray.address is None
    if started:
        _keep_local_ray_on_loopback()
    import ray

    kwargs = dict(namespace="specdec", logging_level="WARNING" if quiet else "INFO")
    if started:
        env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
               _RAY_LOOPBACK_ENV[0]: _RAY_LOOPBACK_ENV[1]}
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
    from specdec.app.ray_actors import DRAFT_RESOURCE, TARGET_RESOURCE, specdec_resources, wait_for_resources

    draft_model = config.draft.kind == "model"
    if not started and specdec_resources():
        needed = [TARGET_RESOURCE] + ([DRAFT_RESOURCE] if draft_model else [])

        def tell(missing: list[str]) -> None:
            _say(f"specdec: waiting up to {config.ray.worker_wait:g}s for Ray worker nodes with "
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


def _serve_with_ray(config: ServiceConfig, quiet: bool, signals: _Signals) -> int:
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


def _serve_deployment(config: ServiceConfig, signals: _Signals, started: bool, t0: float, dashboard: str,
                      metrics_url: str) -> int:
    """Launch the actors, serve until a signal, drain; the exit status."""
    import ray

    from specdec.app.ray_actors import launch, ray_is_up

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
    where = f"{config.server.host}:{deployment.port} (gRPC){_http_note(config, deployment.http_port)}"
    extra = f"; dashboard at {dashboard}" if dashboard else ""
    _say(f"specdec serving {_describe(config)} on {where}{extra} "
         f"(ready in {time.perf_counter() - t0:.1f}s; workers: target {deployment.target_address}"
         f"{', draft ' + deployment.draft_address if deployment.draft_address else ''})")
    _say(kv_summary(deployment.replicas[0].info["info"], config.replicas.count))
    if metrics_url:
        _say(f"specdec metrics (Prometheus, ray_specdec_*) at {metrics_url}")
    signals.wait()
    if not ray_is_up():
        _say(f"specdec: {signals.received}, but Ray's processes are gone (stopped first): nothing to drain")
        return 0
    grace = config.server.grace_period
    _say(f"specdec: {signals.received}, draining (grace {grace:g}s)")
    snapshot = deployment.drain_and_stop(grace)
    if snapshot:
        rate = snapshot.get("acceptance_rate")
        _say(f"specdec: stopped after {snapshot.get('rounds', 0)} rounds, {snapshot.get('generated_tokens', 0)} "
             f"tokens" + (f", acceptance rate {rate:.3f}" if rate is not None else ""))
    else:
        _say("specdec: stopped")
    return 0


def _leave_ray(ray, error: BaseException | None = None) -> None:
    """ray.shutdown(): stops the local instance if this command started it, else disconnects.

    With Ray's GCS gone, ray.shutdown() (and the one Ray's atexit hook runs) waits 15-60 s for it:
    then the local processes that remain are killed and the process exits here, with its output
    flushed and the status it would have had (`error`: the exception on its way out)."""
    from specdec.app.ray_actors import ray_is_up

    if ray_is_up():
        ray.shutdown()
        return
    node = getattr(ray._private.worker, "_global_node", None)
    with contextlib.suppress(Exception):  # best effort: what is left dies with its parent anyway
        if node is not None:
            node.kill_all_processes(check_alive=False, allow_graceful=False)
    status = 0
    if isinstance(error, ServeError):
        print(f"specdec serve: error: {error}", file=sys.stderr)
        status = 2
    elif error is not None:
        import traceback

        traceback.print_exception(error)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run(args) -> int:
    signals = _Signals()
    try:
        config = build_config(args)
        _warn_exposure(config)
        check_port_free(config.server.host, config.server.port)
        if config.server.http_port > 0:
            check_port_free(config.server.host, config.server.http_port, "--http-port")
        if not config.ray.enabled:
            return _serve_in_process(config, signals)
        if config.ray.address is None:  # this command starts Ray: keep group signals away from it
            return _in_own_session(lambda: _serve_with_ray(config, args.quiet, signals))
        return _serve_with_ray(config, args.quiet, signals)
    except ServeError as e:
        print(f"specdec serve: error: {e}", file=sys.stderr, flush=True)
        return 2
