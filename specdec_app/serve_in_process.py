"""`specdec serve --no-ray`: the whole service in this process (development, tests): one
scheduler factory per replica, the public servers on their own thread, until a signal; then drain.
"""
from __future__ import annotations

from coordinator.frontend.server import GenerationServer
from coordinator.frontend.server_thread import ServerThread
from coordinator.telemetry.metrics import RoundMetrics
from specdec.config import ServiceConfig
from specdec_app.embedded import LocalReplicaLauncher, LocalSchedulerFactory
from specdec_app.serve_messages import ServeError, describe, http_note, kv_summary, say
from specdec_app.serve_signals import DrainSignals


def serve_in_process(config: ServiceConfig, signals: DrainSignals) -> int:
    factories = [LocalSchedulerFactory(config) for _ in range(config.replicas.count)]
    server = GenerationServer(factories, factories[0].tokenizer, config.server, RoundMetrics(config.ray.name),
                              launcher=LocalReplicaLauncher(config), replica_config=config.replicas)
    handle = ServerThread(server)
    try:
        port = handle.start(wait_ready=True)
    except Exception as e:  # noqa: BLE001
        handle.stop(0)
        raise ServeError(f"could not start: {e}") from e
    http = http_note(config, handle.http_port)
    say(f"specdec serving {describe(config)} on {config.server.host}:{port} (gRPC){http} (in-process, no Ray)")
    say(kv_summary(factories[0].target_worker.info(), config.replicas.count))
    signals.wait()
    say(f"specdec: {signals.received}, draining (grace {config.server.grace_period:g}s)")
    handle.stop()
    say("specdec: stopped")
    return 0
