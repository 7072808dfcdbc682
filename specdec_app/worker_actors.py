"""The worker actors: `TargetWorkerActor` / `DraftWorkerActor` build their worker from its role
config (specdec.config) inside the actor process and serve it with target_worker.grpc_server /
draft_worker.grpc_server on `host:port`.

The default host is 127.0.0.1: workers are internal and never listen on a public address unless
asked to. In a cluster pass the node's address (`host="node-ip"` resolves to the Ray node IP).
Ports are chosen before the actor starts and passed in (specdec_app.ray_cluster.worker_port), so
that a worker Ray restarts reloads its model and comes back on the same port. The only actor
calls are start-up (`ready`, `address`) and shutdown (`stop`); rounds travel over gRPC.
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict

import ray

from draft_worker import grpc_server as draft_server
from draft_worker.worker import DraftWorker
from specdec.addresses import host_port
from specdec.config import DraftConfig, TargetConfig
from specdec_app.ray_cluster import advertised, resolve_host
from target_worker import grpc_server as target_server
from target_worker.worker import TargetWorker

log = logging.getLogger(__name__)


class _WorkerActorBase:
    kind = ""

    def _serve(self, serve, worker, host: str, port: int) -> None:
        host = resolve_host(host)
        self.worker = worker
        self.server, self.port = serve(worker, host_port(host, port))
        self._address = advertised(host, self.port)
        log.info("%s worker actor serving on %s", self.kind, self._address)

    def address(self) -> str:
        return self._address

    def pid(self) -> int:
        return os.getpid()

    def ready(self) -> dict:
        """Called once after start-up: raises if the constructor failed; returns what is served."""
        info = self.worker.info()
        return {"kind": self.kind, "address": self._address, "pid": os.getpid(),
                "node_ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "info": asdict(info)}

    def stop(self, grace_s: float = 1.0) -> None:
        self.server.stop(grace_s).wait()


@ray.remote(max_task_retries=0)
class TargetWorkerActor(_WorkerActorBase):
    kind = "target"

    def __init__(self, config: TargetConfig, host: str, port: int):
        self._serve(target_server.serve, TargetWorker.from_config(config), host, port)


@ray.remote(max_task_retries=0)
class DraftWorkerActor(_WorkerActorBase):
    kind = "draft"

    def __init__(self, config: DraftConfig, host: str, port: int):
        self._serve(draft_server.serve, DraftWorker.from_config(config), host, port)
