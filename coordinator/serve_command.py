"""`specdec serve`: start the service.

With no arguments: start a local Ray instance (dashboard on http://127.0.0.1:8265), put the
shipped pair (models/target drafted by models/draft) in Ray actors, and serve Generate on
0.0.0.0:50051. Workers listen on 127.0.0.1 only; only the coordinator's public port is open.

  specdec serve                                   # shipped pair, local Ray, port 50051
  specdec serve --target DIR --draft ngram        # n-gram (prompt lookup) drafting
  specdec serve --ray-address auto --worker-host node-ip   # join a running cluster
  specdec serve --no-ray                          # one process, no Ray (development, tests)

SIGTERM / SIGINT drain: the server refuses new requests (UNAVAILABLE), in-flight requests run to
completion for up to --grace-period seconds, then the actors stop, Ray shuts down if this command
started it, and the exit status is 0. A second signal exits at once (status 1).

On a cluster whose nodes carry specdec_* resources (k8s/raycluster.yaml) the command first waits
for the target/draft worker nodes (--worker-wait), and each actor goes to its own node. A worker
whose process dies is restarted by Ray (--max-restarts) on the same port: requests in flight end
with UNAVAILABLE, requests after its recovery succeed.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_TARGET = REPO_ROOT / "models" / "target"
SHIPPED_DRAFT = REPO_ROOT / "models" / "draft"


class ServeError(Exception):
    """A problem the user can fix (bad path, port in use): printed without a traceback."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__.split("\n\n", 1)[1]
    m = parser.add_argument_group("models")
    m.add_argument("--target", default=None, help=f"target checkpoint directory (default: {SHIPPED_TARGET})")
    m.add_argument("--draft", default=None,
                   help="draft checkpoint directory, 'ngram' (prompt lookup) or 'none' (target only); "
                        "default: the shipped draft with the shipped target, else none")
    m.add_argument("--num-speculative-tokens", "-k", type=int, default=5, help="draft tokens per round (K)")
    m.add_argument("--device", default="cpu", help="cpu or cuda (workers ask Ray for one GPU each on cuda)")
    m.add_argument("--dtype", default=None, help="float32 (default on cpu), bfloat16 (default on cuda), float16")
    m.add_argument("--max-batch-size", type=int, default=32, help="requests per round at most")
    m.add_argument("--kv-cache-blocks", type=int, default=None, help="KV-cache blocks per worker (default: sized "
                   "for max_batch_size sequences of full length)")
    n = parser.add_argument_group("network")
    n.add_argument("--host", default="0.0.0.0", help="public bind address of the Generation service")
    n.add_argument("--port", type=int, default=50051, help="public port (0: any free port)")
    n.add_argument("--worker-host", default=None,
                   help="bind address of the worker gRPC servers: 127.0.0.1 (default for a local Ray "
                        "instance; free ports) or 'node-ip' (each node's Ray IP, the default with --ray-address; "
                        "ports $SPECDEC_TARGET_WORKER_PORT / $SPECDEC_DRAFT_WORKER_PORT, default 50061 / 50062)")
    n.add_argument("--tls-cert", default=None, help="PEM certificate for the public port (with --tls-key)")
    n.add_argument("--tls-key", default=None, help="PEM private key for the public port")
    n.add_argument("--auth-token", default=os.environ.get("SPECDEC_AUTH_TOKEN"),
                   help="require 'authorization: Bearer <token>' (default: $SPECDEC_AUTH_TOKEN; unset = open)")
    n.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM/SIGINT")
    r = parser.add_argument_group("ray")
    r.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. 'auto', 'ray-head:6379') instead of starting one")
    r.add_argument("--no-ray", action="store_true",
                   help="serve in this one process without Ray (no actors, no dashboard): for development, "
                        "tests and machines where Ray start-up is too slow")
    r.add_argument("--dashboard-host", default="127.0.0.1", help="dashboard bind address (local Ray only)")
    r.add_argument("--dashboard-port", type=int, default=8265, help="dashboard port (local Ray only)")
    r.add_argument("--name", default="specdec",
                   help="deployment name: actors are <name>-target/-draft/-coordinator in namespace 'specdec'")
    r.add_argument("--worker-cpus", type=float, default=1.0, help="CPUs Ray reserves for each worker actor")
    r.add_argument("--max-restarts", type=int, default=3, help="times Ray restarts a dead actor (-1: forever)")
    r.add_argument("--worker-wait", type=float, default=600.0,
                   help="with --ray-address on a cluster that has specdec_* node resources (KubeRay): seconds "
                        "to wait for the target/draft worker nodes to join before giving up")
    parser.add_argument("--quiet", action="store_true", help="less Ray logging")


# --- argument checks --------------------------------------------------------------------------


def _check_model_dir(path: str, what: str) -> str:
    p = Path(path).expanduser()
    if not p.is_dir():
        hint = ""
        if p.resolve() in (SHIPPED_TARGET.resolve(), SHIPPED_DRAFT.resolve()):
            hint = " (the shipped models are built by scripts/ in this repository; or pass --target/--draft)"
        raise ServeError(f"{what} model directory {p} does not exist{hint}")
    if not (p / "config.json").is_file():
        raise ServeError(f"{what} model directory {p} has no config.json (expected a Hugging Face "
                         "Llama checkpoint: config.json + *.safetensors)")
    if not any(p.glob("*.safetensors")):
        raise ServeError(f"{what} model directory {p} has no *.safetensors weights")
    return str(p.resolve())


def resolve_models(args) -> tuple[str, str | None]:
    target = args.target if args.target is not None else str(SHIPPED_TARGET)
    target = _check_model_dir(target, "target")
    draft = args.draft
    if draft is None:
        draft = str(SHIPPED_DRAFT) if args.target is None else "none"
    if draft.lower() == "none":
        return target, None
    if draft == "ngram":
        return target, "ngram"
    return target, _check_model_dir(draft, "draft")


def check_port_free(host: str, port: int) -> None:
    """Fail early and clearly (before Ray starts) if the public port is taken."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host.strip("[]"), port))
        except PermissionError:
            raise ServeError(f"no permission to bind {host}:{port}: choose a port above 1023 with --port") from None
        except OSError as e:
            raise ServeError(f"port {port} on {host} is in use ({e.strerror}): is another specdec serve "
                             f"running? Choose another with --port") from None


def _options(args) -> dict:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ServeError("--tls-cert and --tls-key go together")
    for path in (args.tls_cert, args.tls_key):
        if path is not None and not Path(path).is_file():
            raise ServeError(f"TLS file {path} does not exist")
    options = {}
    if args.tls_cert:
        options.update(tls_cert=str(Path(args.tls_cert).resolve()), tls_key=str(Path(args.tls_key).resolve()))
    if args.auth_token:
        options["auth_token"] = args.auth_token
    return options


def _dtype(args) -> str:
    if args.dtype:
        return args.dtype
    return "bfloat16" if args.device.startswith("cuda") else "float32"


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


def _say(message: str) -> None:
    print(message, flush=True)


def _describe(target: str, draft: str | None) -> str:
    return f"{target} (+draft {draft})" if draft else f"{target} (no draft)"


# --- the two ways to serve ---------------------------------------------------------------------


def _serve_in_process(args, target: str, draft: str | None, signals: _Signals) -> int:
    from coordinator.embedded import build_local_scheduler
    from coordinator.metrics import make_round_callback
    from coordinator.server import GenerationServer, ServerThread

    factory, tokenizer = build_local_scheduler(target, draft, args.num_speculative_tokens, args.device, _dtype(args),
                                               args.max_batch_size, args.kv_cache_blocks)
    server = GenerationServer(factory, tokenizer, address=f"{args.host}:{args.port}",
                              on_round=make_round_callback(args.name), **_options(args))
    handle = ServerThread(server)
    try:
        port = handle.start(wait_ready=True)
    except Exception as e:  # noqa: BLE001
        handle.stop(0)
        raise ServeError(f"could not start: {e}") from e
    _say(f"specdec serving {_describe(target, draft)} on {args.host}:{port} (in-process, no Ray)")
    signals.wait()
    _say(f"specdec: {signals.received}, draining (grace {args.grace_period:g}s)")
    handle.stop(args.grace_period)
    _say("specdec: stopped")
    return 0


def _ray_init(args):
    import ray

    started = args.ray_address is None
    kwargs = dict(namespace="specdec", logging_level="WARNING" if args.quiet else "INFO")
    if started:
        env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
        context = ray.init(include_dashboard=True, dashboard_host=args.dashboard_host,
                           dashboard_port=args.dashboard_port, num_cpus=max(os.cpu_count() or 1, 2),
                           runtime_env={"env_vars": env}, **kwargs)
    else:
        context = ray.init(address=args.ray_address, **kwargs)
    url = getattr(context, "dashboard_url", None) or ""
    if url and not url.startswith("http"):
        url = f"http://{url}"
    info = getattr(context, "address_info", None) or {}
    metrics_port = info.get("metrics_export_port")
    metrics = f"http://{info.get('node_ip_address', '127.0.0.1')}:{metrics_port}/metrics" if metrics_port else ""
    return ray, started, url, metrics


def _plan_gpus(ray, args, draft: str | None, started: bool, stop=None) -> float | None:
    """GPUs per worker actor (None: one each), after waiting for the worker nodes of a cluster.

    A cluster laid out for specdec (custom resources specdec_*, as in k8s/raycluster.yaml) gets
    its worker nodes waited for (--worker-wait) and one GPU per worker. Otherwise two GPU workers
    on a single machine with one GPU share it (0.5 each) rather than wait forever; on a multi-node
    cluster they are never made to share, since more GPU nodes may still be joining."""
    from coordinator.ray_actors import DRAFT_RESOURCE, TARGET_RESOURCE, specdec_resources, wait_for_resources

    if not started and specdec_resources():
        needed = [TARGET_RESOURCE] + ([DRAFT_RESOURCE] if draft not in (None, "ngram") else [])

        def tell(missing: list[str]) -> None:
            _say(f"specdec: waiting up to {args.worker_wait:g}s for Ray worker nodes with {', '.join(missing)} "
                 "to join (`ray status` shows the nodes)")

        try:
            wait_for_resources(needed, args.worker_wait, tell, stop=stop)
        except TimeoutError as e:
            raise ServeError(str(e)) from None
        return None
    if not (args.device.startswith("cuda") and draft not in (None, "ngram")):
        return None
    have = ray.cluster_resources().get("GPU", 0)
    single_node = sum(1 for n in ray.nodes() if n.get("Alive")) == 1
    if 0 < have < 2 and (started or single_node):
        return have / 2
    return None


def _serve_with_ray(args, target: str, draft: str | None, signals: _Signals) -> int:
    t0 = time.perf_counter()
    ray, started, dashboard, metrics_url = _ray_init(args)
    signals.install()
    try:
        if signals.stop.is_set():
            return 0
        from coordinator.ray_actors import launch

        worker_host = args.worker_host or ("127.0.0.1" if started else "node-ip")
        gpus = _plan_gpus(ray, args, draft, started, signals.stop)
        if signals.stop.is_set():
            return 0
        try:
            deployment = launch(
                target, draft, num_speculative_tokens=args.num_speculative_tokens, host=args.host, port=args.port,
                device=args.device, dtype=_dtype(args), worker_host=worker_host, name_prefix=args.name,
                server_options=_options(args), kv_cache_blocks=args.kv_cache_blocks, target_gpus=gpus,
                draft_gpus=gpus, worker_cpus=args.worker_cpus, max_batch_size=args.max_batch_size,
                max_restarts=args.max_restarts)
        except (RuntimeError, ValueError) as e:
            raise ServeError(f"could not start the service: {e}") from e
        if signals.stop.is_set():
            deployment.drain_and_stop(0)
            return 0
        where = f"{args.host}:{deployment.port}"
        extra = f"; dashboard at {dashboard}" if dashboard else ""
        _say(f"specdec serving {_describe(target, draft)} on {where}{extra} "
             f"(ready in {time.perf_counter() - t0:.1f}s; workers: target {deployment.target_address}"
             f"{', draft ' + deployment.draft_address if deployment.draft_address else ''})")
        if metrics_url:
            _say(f"specdec metrics (Prometheus, ray_specdec_*) at {metrics_url}")
        signals.wait()
        _say(f"specdec: {signals.received}, draining (grace {args.grace_period:g}s)")
        snapshot = deployment.drain_and_stop(args.grace_period)
        if snapshot:
            rate = snapshot.get("acceptance_rate")
            _say(f"specdec: stopped after {snapshot.get('rounds', 0)} rounds, {snapshot.get('generated_tokens', 0)} "
                 f"tokens" + (f", acceptance rate {rate:.3f}" if rate is not None else ""))
        else:
            _say("specdec: stopped")
        return 0
    finally:
        ray.shutdown()  # stops the local instance if this command started it; else just disconnects


def run(args) -> int:
    signals = _Signals()
    try:
        if args.num_speculative_tokens < 0:
            raise ServeError("--num-speculative-tokens must be >= 0")
        target, draft = resolve_models(args)
        check_port_free(args.host, args.port)
        _options(args)
        if args.no_ray:
            return _serve_in_process(args, target, draft, signals)
        return _serve_with_ray(args, target, draft, signals)
    except ServeError as e:
        print(f"specdec serve: error: {e}", file=sys.stderr, flush=True)
        return 2
