"""The coordinator actor and the deployment: Ray places and supervises the processes, gRPC carries
the rounds.

- `CoordinatorActor` connects GrpcTargetClient / GrpcDraftClient to the worker actors' addresses
  (specdec_app.worker_actors) and runs the public Generation server (coordinator.frontend.server)
  on the public ports (gRPC and, unless http_port is 0, the OpenAI-compatible HTTP API), with the
  metrics callback (coordinator.telemetry.metrics) so that the Ray dashboard shows acceptance,
  tokens/s, latency, queue.
- `launch(config)` starts every replica's workers (specdec_app.ray_replicas: one placement group
  per replica) and the coordinator, and returns a `Deployment`; `specdec serve` and the tests use
  it.

Per-round traffic never goes through Ray actor calls (~4 ms each here, see DESIGN.md): the only
actor calls are start-up (`ready`, `address`) and shutdown (`drain_and_stop`, `stop`).

Actors are named (`<prefix>-target`, `<prefix>-draft`, `<prefix>-coordinator`; replica i > 0:
`<prefix>-target-<i>`, `<prefix>-draft-<i>`) in the `specdec` namespace and are restarted by Ray
if their process dies (`max_restarts`; `max_task_retries=0`, since a replayed start-up or
shutdown call is never wanted). A restarted worker comes back on the same port (its port is
chosen before it starts); the coordinator's clients reconnect to it on their next round (and ask
the actor for its address after a failure, in case Ray restarted it on another node). Requests in
flight when a worker dies pause and resume once it is back (coordinator.rounds.scheduler); only a
worker Ray will not restart fails them.

Placement (see k8s/README.md, "What the actor code must match"): the coordinator asks for
`specdec_coordinator` when the cluster has it (only the KubeRay head does), else it is pinned to
the caller's node; the workers' resources and ports are specdec_app.ray_cluster's.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coordinator.frontend.server import GenerationServer
from coordinator.frontend.server_thread import ServerThread
from coordinator.rounds.errors import WorkerGone
from coordinator.telemetry.metrics import RoundMetrics
from specdec.addresses import is_loopback
from specdec.config import ServiceConfig
from specdec_app.embedded import GrpcSchedulerFactory
from specdec_app.ray_cluster import COORDINATOR_RESOURCE, NAMESPACE, advertised, get_while_up, ray_is_up
from specdec_app.ray_replicas import (
    RayReplicaLauncher,
    remove_leftover_groups,
    start_replica,
    stop_replica,
    wait_replica,
)

log = logging.getLogger(__name__)


@ray.remote(max_task_retries=0, max_concurrency=4)
class CoordinatorActor:
    """Runs the public Generation server (grpc.aio, on its own thread and event loop) in the actor.

    Threaded (max_concurrency 4) so metrics_snapshot() answers while drain_and_stop() waits."""

    def __init__(self, config: ServiceConfig, replicas: list[dict], namespace: str = NAMESPACE):
        """`replicas`: each replica's worker addresses and actor names (ReplicaActors.spec())."""
        self.namespace = namespace
        self.config = config
        self.wire = WireSum()
        factories = [self._factory(spec) for spec in replicas]
        self.launcher = RayReplicaLauncher(config, replicas, self._factory) if config.replicas.autoscaling else None
        self.metrics = RoundMetrics(config.ray.name, wire=self.wire.counters)
        self.handle = ServerThread(GenerationServer(factories, factories[0].tokenizer, config.server, self.metrics,
                                                    launcher=self.launcher, replica_config=config.replicas))
        try:
            self.port = self.handle.start(wait_ready=True)  # raises if the workers cannot be reached
        except BaseException:
            self.handle.stop(0)
            raise
        self._address = advertised(config.server.host, self.port)

    def _factory(self, spec: dict):
        """A replica's scheduler factory. After a worker failure its clients ask the worker's actor
        where it serves now (Ray may restart it on another node); never on the round path. A worker
        that hangs past the round deadline is killed through Ray, which restarts it: a stopped
        process would never come back."""
        factory = GrpcSchedulerFactory(self.config, spec["target_address"], spec["draft_address"])
        self.wire.add(factory.wire)
        for client, name in ((factory.target_client, spec["target_name"]), (factory.draft_client, spec["draft_name"])):
            if client is not None and name:
                client.resolve_address = _address_resolver(name, self.namespace)
                client.on_hang = _restarter(name, self.namespace)
        return factory

    def ready(self) -> dict:
        return {"kind": "coordinator", "address": self._address, "port": self.port,
                "http_port": self.handle.http_port, "pid": os.getpid(),
                "node_ip": ray.util.get_node_ip_address(), "metrics_exported": self.metrics.exporting}

    def address(self) -> str:
        return self._address

    def metrics_snapshot(self) -> dict:
        return self.metrics.snapshot()

    def drain_and_stop(self, grace_s: float | None = None) -> dict:
        """Stop accepting requests, let in-flight ones finish (up to grace_s; default: the
        config's grace_period), stop the server and the replicas autoscaling added."""
        self.handle.stop(grace_s)
        self.metrics.close()
        if self.launcher is not None:
            self.launcher.stop_all()
        return self.metrics.snapshot()

    def routing(self) -> dict:
        """Replicas routed to now (autoscaling changes it) and requests moved between them."""
        router = self.handle.server.scheduler
        return {"replicas": [r.index for r in router.replicas], "moved_requests": router.moved_requests}


class WireSum:
    """Bytes on the wire per worker role, summed over every replica's gRPC clients (the metrics
    read `bytes_sent` / `bytes_received` of one counter per role)."""

    class _Sum:
        def __init__(self):
            self.parts: list = []

        @property
        def bytes_sent(self) -> int:
            return sum(p.bytes_sent for p in self.parts)

        @property
        def bytes_received(self) -> int:
            return sum(p.bytes_received for p in self.parts)

    def __init__(self):
        self.counters: dict[str, WireSum._Sum] = {}

    def add(self, wire: dict) -> None:
        for role, counter in wire.items():
            self.counters.setdefault(role, self._Sum()).parts.append(counter)


def _restarter(actor_name: str, namespace: str):
    def restart() -> None:
        try:
            ray.kill(ray.get_actor(actor_name, namespace=namespace), no_restart=False)
            log.warning("%s did not answer within the round deadline: killed, Ray restarts it", actor_name)
        except Exception as e:  # noqa: BLE001 - already gone; the recovery timeout decides
            log.warning("could not restart hung worker %s: %s", actor_name, e)
    return restart


def _address_resolver(actor_name: str, namespace: str, timeout_s: float = 1.0):
    """The worker's current address; WorkerGone once Ray will not restart it (an actor that is
    restarting times out instead, and is asked again after the next failed round)."""
    def resolve() -> str:
        try:
            actor = ray.get_actor(actor_name, namespace=namespace)
            return ray.get(actor.address.remote(), timeout=timeout_s)
        except (ValueError, ray.exceptions.ActorDiedError) as e:
            raise WorkerGone(f"Ray will not restart {actor_name} (max_restarts used up, or it was removed): "
                             f"{str(e).splitlines()[0]}", worker=actor_name) from e
    return resolve


# Seconds beyond the grace period that the coordinator's drain may take to answer (stopping its
# servers and scheduler), and that the workers' servers may take to stop after it.
DRAIN_ANSWER_S = 1.5
WORKER_STOP_S = 1.0


@dataclass
class Deployment:
    """Handles to a running deployment (what `launch` returns). `target` / `draft` and their
    addresses are replica 0's; `replicas` has them all (specdec_app.ray_replicas.ReplicaActors)."""

    coordinator: ray.actor.ActorHandle
    replicas: list
    address: str  # the public address clients dial
    port: int
    http_port: int | None  # the OpenAI-compatible HTTP API's port on the coordinator's node; None: off
    startup_seconds: float = 0.0
    info: dict = field(default_factory=dict)
    name: str = ""  # ServiceConfig.ray.name: its replicas' placement groups are named after it

    @property
    def target(self) -> ray.actor.ActorHandle:
        return self.replicas[0].target

    @property
    def draft(self) -> ray.actor.ActorHandle | None:
        return self.replicas[0].draft

    @property
    def target_address(self) -> str:
        return self.replicas[0].target_address

    @property
    def draft_address(self) -> str | None:
        return self.replicas[0].draft_address

    def actors(self) -> list:
        return [self.coordinator] + [a for r in self.replicas for a in r.actors()]

    def drain_and_stop(self, grace_s: float, timeout_s: float | None = None) -> dict | None:
        """Drain the public server (for up to grace_s, answered within timeout_s: default grace_s
        + DRAIN_ANSWER_S), stop the workers' gRPC servers, then kill all actors. Each wait ends
        early once Ray is gone, so the whole takes at most about grace_s + 3 s."""
        snapshot = None
        try:
            snapshot = get_while_up(self.coordinator.drain_and_stop.remote(grace_s),
                                    grace_s + DRAIN_ANSWER_S if timeout_s is None else timeout_s)
        except Exception as e:  # noqa: BLE001 - still tear the rest down
            log.warning("coordinator did not drain cleanly: %s", e)
        workers = [a for r in self.replicas for a in r.actors()]
        if snapshot is not None:  # drained: nothing is in flight, the workers stop at once
            try:
                get_while_up([a.stop.remote(0.5) for a in workers], WORKER_STOP_S)
            except Exception as e:  # noqa: BLE001
                log.warning("workers did not stop cleanly: %s", e)
        self.kill()
        return snapshot

    def kill(self) -> None:
        """Kill every actor and free the placement groups; nothing to do once Ray is gone (the
        actors died with it, and each of these calls would wait on its GCS)."""
        if not ray_is_up():
            return
        for replica in self.replicas:
            stop_replica(replica)
        try:
            ray.kill(self.coordinator, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        if self.name:  # the replicas autoscaling added and did not stop (their actors died with it)
            removed = remove_leftover_groups(self.name)
            if removed:
                log.warning("removed placement groups left behind: %s", ", ".join(removed))


def _coordinator_placement(cluster: dict) -> dict:
    """On the node with `specdec_coordinator` (the KubeRay head) if there is one, else this node."""
    if cluster.get(COORDINATOR_RESOURCE, 0) >= 1:
        return {"resources": {COORDINATOR_RESOURCE: 1}}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(
        node_id=ray.get_runtime_context().get_node_id(), soft=False)}


# Start-up attempts when a loopback worker's free port was taken before the worker bound it.
BIND_ATTEMPTS = 3


def launch(config: ServiceConfig, *, target_gpus: float | None = None, draft_gpus: float | None = None,
           pin_coordinator: bool = True, timeout_s: float = 600.0) -> Deployment:
    """`_launch_once`, again on new free ports when a loopback worker lost its port to another
    process in the seconds between choosing it and binding it (its models load first)."""
    loopback = is_loopback(config.ray.worker_host or "127.0.0.1")
    settings = dict(target_gpus=target_gpus, draft_gpus=draft_gpus, pin_coordinator=pin_coordinator,
                    timeout_s=timeout_s)
    for attempt in range(1, BIND_ATTEMPTS):
        try:
            return _launch_once(config, **settings)
        except RuntimeError as e:
            if not (loopback and "could not bind" in str(e)):
                raise
            log.warning("a worker's port was taken before it bound it; starting again on new ports "
                        "(attempt %d of %d)", attempt + 1, BIND_ATTEMPTS)
    return _launch_once(config, **settings)


def _launch_once(config: ServiceConfig, *, target_gpus: float | None, draft_gpus: float | None,
                 pin_coordinator: bool, timeout_s: float) -> Deployment:
    """Start every replica's worker actors (specdec_app.ray_replicas) and the coordinator actor;
    wait until all are ready.

    The coordinator (the public port) is pinned to the caller's node unless pin_coordinator is
    False, so `specdec serve` on the head node opens the public port there (with
    `specdec_coordinator` in the cluster, on the node that has it). Workers bound to loopback get
    free ports, else config.ray's fixed worker ports; either way a restarted worker comes back
    on the same port. Custom resources `specdec_target` / `specdec_draft` are requested when the
    cluster has them; `*_gpus` None means one GPU per worker on CUDA.
    Raises RuntimeError with the failing actor's error if start-up fails (all actors are killed).
    """
    t0 = time.perf_counter()
    cluster = ray.cluster_resources()
    replicas, coordinator = [], None
    try:
        for index in range(config.replicas.count):
            owner = config.replicas.draft_of(index)
            shared = replicas[owner] if config.draft.kind == "model" and owner != index else None
            replicas.append(start_replica(config, index, cluster, target_gpus=target_gpus, draft_gpus=draft_gpus,
                                          shared_draft=shared))
        # All load their models concurrently; a constructor error surfaces here.
        for replica in replicas:
            wait_replica(replica, timeout_s, replicas[config.replicas.draft_of(replica.index)]
                         if replica.draft is None and replica.draft_name else None)
        placement = _coordinator_placement(cluster) if pin_coordinator else {}
        coordinator = CoordinatorActor.options(
            name=f"{config.ray.name}-coordinator", num_cpus=0, namespace=NAMESPACE,
            max_restarts=config.ray.max_restarts, max_task_retries=0, lifetime="non_detached", **placement,
        ).remote(config, [r.spec() for r in replicas])
        coord_info = ray.get(coordinator.ready.remote(), timeout=timeout_s)
    except BaseException as e:
        for replica in replicas:
            stop_replica(replica)
        if coordinator is not None:
            try:
                ray.kill(coordinator, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise RuntimeError(_explain_start_error(e)) from e
    return Deployment(coordinator=coordinator, replicas=replicas, address=coord_info["address"],
                      port=coord_info["port"], http_port=coord_info["http_port"],
                      startup_seconds=time.perf_counter() - t0,
                      info={"target": replicas[0].info, "coordinator": coord_info}, name=config.ray.name)


def _explain_start_error(e: BaseException) -> str:
    """The root cause of a failed actor start, without Ray's long wrapper text if possible."""
    cause = getattr(e, "cause", None) or getattr(e, "__cause__", None)
    if isinstance(e, ValueError) and "already taken" in str(e):
        return f"{e} (another specdec deployment with the same name runs in this Ray cluster)"
    if cause is not None and not isinstance(cause, type(e)):
        return f"{type(cause).__name__}: {cause}"
    text = str(e)
    return text if len(text) < 4000 else text[-4000:]
