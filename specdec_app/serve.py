"""`specdec serve`: start the service.

With no arguments: start a local Ray instance (dashboard on http://127.0.0.1:8265), put the
shipped pair (models/target drafted by models/draft) in Ray actors, and serve Generate (gRPC) on
127.0.0.1:50051 and the OpenAI-compatible HTTP API on 127.0.0.1:8000 (--http-port; 0: off).
Everything listens on loopback by default: the public ports (--host 0.0.0.0 opens them, and then
a missing --auth-token or TLS is warned about at start-up and on /health), the workers, and the
local Ray instance this command starts (specdec_app/serve_ray.py).

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
own, which only the command signals (specdec_app/serve_signals.py). If Ray's processes were stopped first,
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
import socket
from pathlib import Path

from specdec.config import SHIPPED_DRAFT, SHIPPED_TARGET, ConfigError, ServiceConfig
from specdec.model.config import ModelConfig
from specdec.model.source import ModelSourceError, resolve_model_source
from specdec_app.flags import SERVE_SETTINGS, add_settings, all_serve_settings, given_settings
from specdec_app.serve_messages import ServeError, print_error, warn_exposure
from specdec_app.serve_signals import DrainSignals, in_own_session

DRAFT_DEFAULT_NOTE = "models/draft with the shipped target, else none"


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


# --- the two ways to serve: in this process, or on Ray (specdec_app.serve_ray) -----------------


def _serve_in_process(config: ServiceConfig, signals: DrainSignals) -> int:
    # Imported here, not above: the coordinator loads gRPC and fastapi, which the Ray path's
    # parent process never uses (the coordinator runs in an actor) and should not fork with.
    from specdec_app.serve_in_process import serve_in_process

    return serve_in_process(config, signals)


def _serve_with_ray(config: ServiceConfig, quiet: bool, signals: DrainSignals) -> int:
    # Imported here, not above: it imports Ray, which `--no-ray` never loads, and in
    # in_own_session's child, so that the parent has no Ray threads when it forks.
    from specdec_app.serve_ray import serve_with_ray

    return serve_with_ray(config, quiet, signals)


def run(args) -> int:
    signals = DrainSignals()
    try:
        config = build_config(args)
        warn_exposure(config)
        check_port_free(config.server.host, config.server.port)
        if config.server.http_port > 0:
            check_port_free(config.server.host, config.server.http_port, "--http-port")
        if not config.ray.enabled:
            return _serve_in_process(config, signals)
        if config.ray.address is None:  # this command starts Ray: keep group signals away from it
            return in_own_session(lambda: _serve_with_ray(config, args.quiet, signals))
        return _serve_with_ray(config, args.quiet, signals)
    except ServeError as e:
        print_error(e)
        return 2
