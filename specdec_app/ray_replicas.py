"""Target replicas as Ray actors: where each replica's workers go and how one is added or removed.

A replica is one target worker actor (its own paged KV cache) plus, when the draft is a model and
the replica owns one (ReplicaConfig.owns_draft), a draft worker actor; replicas beyond
`draft_replicas` draft with replica `i mod draft_replicas`'s draft worker, and the n-gram drafter
runs in the coordinator with no worker at all. Each replica's actors go in one Ray placement group:
PACK (a target and its draft on one node when they fit) or SPREAD (`draft_placement`). A placement
group that asks for resources the cluster lacks is what makes Ray's autoscaler (KubeRay's, in a
cluster) add a node. Replica 0's actors keep the names `<name>-target` / `<name>-draft`; replica i
> 0 gets `<name>-target-<i>` / `<name>-draft-<i>`.
"""
from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from specdec.config import ServiceConfig
from specdec_app.ray_cluster import DRAFT_RESOURCE, NAMESPACE, TARGET_RESOURCE, worker_port
from specdec_app.worker_actors import DraftWorkerActor, TargetWorkerActor

log = logging.getLogger(__name__)


def actor_name(name: str, role: str, index: int) -> str:
    return f"{name}-{role}" if index == 0 else f"{name}-{role}-{index}"


@dataclass
class ReplicaActors:
    """One replica's Ray handles and where its workers serve."""

    index: int
    target: ray.actor.ActorHandle
    target_name: str
    target_address: str = ""
    draft: ray.actor.ActorHandle | None = None  # None: shares another replica's draft, or no draft actor
    draft_name: str | None = None
    draft_address: str | None = None
    placement_group: PlacementGroup | None = None
    group_name: str | None = None
    info: dict | None = None

    def spec(self) -> dict:
        """What the coordinator needs to drive this replica (plain data: it crosses Ray)."""
        return {"index": self.index, "target_address": self.target_address, "draft_address": self.draft_address,
                "target_name": self.target_name, "draft_name": self.draft_name,
                "placement_group": self.group_name}

    def actors(self) -> list:
        return [a for a in (self.draft, self.target) if a is not None]


def _bundle(device: str, gpus: float | None, cpus: float, custom: str, cluster: dict) -> dict:
    bundle = {"CPU": cpus} if cpus else {}
    if device.startswith("cuda"):
        bundle["GPU"] = 1 if gpus is None else gpus
    if cluster.get(custom, 0) >= 1:
        bundle[custom] = 1
    return bundle or {"CPU": 0.01}  # a bundle may not be empty


def start_replica(config: ServiceConfig, index: int, cluster: dict, *, target_gpus: float | None = None,
                  draft_gpus: float | None = None, shared_draft: ReplicaActors | None = None) -> ReplicaActors:
    """Create replica `index`'s placement group and actors (not waiting for them to load).
    `shared_draft`: the replica whose draft worker this one uses, if it does not own one."""
    ray_config, name = config.ray, config.ray.name
    host = ray_config.worker_host or "127.0.0.1"
    owns_draft = config.draft.kind == "model" and shared_draft is None
    bundles = [_bundle(config.target.device, target_gpus, ray_config.worker_cpus, TARGET_RESOURCE, cluster)]
    if owns_draft:
        bundles.append(_bundle(config.draft.device, draft_gpus, ray_config.worker_cpus, DRAFT_RESOURCE, cluster))
    strategy = "PACK" if config.replicas.draft_placement == "colocated" else "SPREAD"
    group_name = actor_name(name, "replica", index)
    group = placement_group(bundles, strategy=strategy, name=group_name)
    common = dict(namespace=NAMESPACE, max_restarts=ray_config.max_restarts, max_task_retries=0,
                  lifetime="non_detached", num_cpus=0)

    def placed(bundle: int) -> dict:
        resources = {k: v for k, v in bundles[bundle].items() if k not in ("CPU", "GPU")}
        return dict(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle),
                    num_cpus=bundles[bundle].get("CPU", 0), num_gpus=bundles[bundle].get("GPU", 0),
                    resources=resources)

    target_name = actor_name(name, "target", index)
    target = TargetWorkerActor.options(name=target_name, **{**common, **placed(0)}).remote(
        config.target, host, worker_port(host, ray_config.target_worker_port))
    replica = ReplicaActors(index, target, target_name, placement_group=group, group_name=group_name)
    if owns_draft:
        replica.draft_name = actor_name(name, "draft", index)
        replica.draft = DraftWorkerActor.options(name=replica.draft_name, **{**common, **placed(1)}).remote(
            config.draft, host, worker_port(host, ray_config.draft_worker_port))
    elif shared_draft is not None:
        replica.draft_name = shared_draft.draft_name
    return replica


def wait_replica(replica: ReplicaActors, timeout_s: float, shared_draft: ReplicaActors | None = None) -> None:
    """Wait until the replica's workers have loaded their models; fill in their addresses."""
    infos = ray.get([a.ready.remote() for a in replica.actors()], timeout=timeout_s)
    replica.info = infos[-1]
    replica.target_address = infos[-1]["address"]
    if replica.draft is not None:
        replica.draft_address = infos[0]["address"]
    elif shared_draft is not None:
        replica.draft_address = shared_draft.draft_address


def stop_replica(replica: ReplicaActors) -> None:
    """Kill the replica's own actors and free its placement group."""
    for actor in replica.actors():
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    if replica.placement_group is not None:
        try:
            remove_placement_group(replica.placement_group)
        except Exception:  # noqa: BLE001
            pass


def remove_leftover_groups(name: str) -> list[str]:
    """Remove the placement groups of deployment `name`'s replicas that are still there, by name:
    a placement group outlives the coordinator actor that made it (it lives as long as the Ray
    job), so replicas the coordinator added and could not stop would keep their resources.
    Returns the names removed."""
    pattern = re.compile(re.escape(actor_name(name, "replica", 0)) + r"(-\d+)?")
    removed = []
    for group_id, group in placement_group_table().items():
        if group["state"] != "REMOVED" and pattern.fullmatch(group["name"] or ""):
            try:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group_id)))
                removed.append(group["name"])
            except Exception:  # noqa: BLE001 - removed meanwhile
                pass
    return removed


class RayReplicaLauncher:
    """Adds and removes replicas for the coordinator's autoscaler (coordinator.replicas.router.ReplicaLauncher),
    from inside the coordinator actor. `make_factory(spec)` turns a replica's spec into its
    scheduler factory. A replica counts as started from the moment its actors are asked for, so
    `stop_all` also stops one still loading its models, and no replica starts after it."""

    def __init__(self, config: ServiceConfig, replicas: list[dict], make_factory, timeout_s: float | None = None):
        self.config = config
        self.make_factory = make_factory
        self.timeout_s = config.ray.worker_wait if timeout_s is None else timeout_s
        self.started: dict[int, ReplicaActors] = {}
        self.specs = {spec["index"]: spec for spec in replicas}
        self._lock = threading.Lock()  # started and _stopped, between add's thread and stop_all
        self._stopped = False

    def add(self, index: int):
        config = self.config
        owner = config.replicas.draft_of(index)
        shared = None
        if config.draft.kind == "model" and owner != index and owner in self.specs:  # (specs: the ready ones)
            shared = self.started.get(owner) or self._handles_of(self.specs[owner])
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"replica {index} not added: the deployment is stopping")
            replica = self.started[index] = start_replica(config, index, ray.cluster_resources(), shared_draft=shared)
        try:
            wait_replica(replica, self.timeout_s, shared)
        except BaseException:
            with self._lock:
                ours = self.started.pop(index, None) is replica
            if ours:  # (else stop_all stopped it while it loaded)
                stop_replica(replica)
            raise
        self.specs[index] = replica.spec()
        return self.make_factory(replica.spec())

    def remove(self, index: int) -> None:
        replica = self.started.pop(index, None)
        spec = self.specs.pop(index, None)
        if replica is None:  # started by `launch`: found by its actors' names
            replica = self._handles_of(spec)
        if replica is None:
            return
        draft_of = self.config.replicas.draft_of
        if draft_of(index) != index or any(draft_of(i) == index for i in self.specs):
            replica.draft = None  # not its own, or others draft with it: keep that draft worker
        stop_replica(replica)

    @staticmethod
    def _handles_of(spec: dict | None) -> ReplicaActors | None:
        """Handles to a replica started elsewhere (by `launch`), by actor name."""
        if spec is None:
            return None
        target = ray.get_actor(spec["target_name"], namespace=NAMESPACE)
        draft = ray.get_actor(spec["draft_name"], namespace=NAMESPACE) if spec.get("draft_name") else None
        try:
            group = ray.util.get_placement_group(spec["placement_group"]) if spec.get("placement_group") else None
        except ValueError:
            group = None
        return ReplicaActors(spec["index"], target, spec["target_name"], spec["target_address"], draft,
                             spec.get("draft_name"), spec.get("draft_address"), group)

    def stop_all(self) -> None:
        with self._lock:
            self._stopped = True
            indices = list(self.started)
        for index in indices:
            self.remove(index)
