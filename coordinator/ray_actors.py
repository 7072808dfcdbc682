"""Ray actors for the service: Ray places and supervises the processes, gRPC carries the rounds.

- `TargetWorkerActor` / `DraftWorkerActor` load their model inside the actor process and serve it
  with target_worker.grpc_server / draft_worker.grpc_server on `host:port`. The default host is
  127.0.0.1: workers are internal and never listen on a public address unless asked to. In a
  cluster pass the node's address (`host="node-ip"` resolves to the Ray node IP).
- `CoordinatorActor` connects GrpcTargetClient / GrpcDraftClient to those addresses and runs the
  public Generation server (coordinator.server) on the public port, with the metrics callback
  (coordinator.metrics) so that the Ray dashboard shows acceptance, tokens/s, latency, queue.

Per-round traffic never goes through Ray actor calls (~4 ms each here, see DESIGN.md): the only
actor calls are start-up (`ready`, `address`) and shutdown (`drain_and_stop`, `stop`).

`launch(...)` starts all three and returns a `Deployment`; `specdec serve` and the tests use it.
Actors are named (`<prefix>-target`, `<prefix>-draft`, `<prefix>-coordinator`) in the `specdec`
namespace and are restarted by Ray if their process dies (`max_restarts`; `max_task_retries=0`,
since a replayed start-up or shutdown call is never wanted). Worker ports are chosen before the
actor starts and passed in, so that a restarted worker comes back on the same address and the
coordinator's clients reconnect to it on their next round.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ray

log = logging.getLogger(__name__)

NAMESPACE = "specdec"
DEFAULT_MAX_RESTARTS = 3
REPO_ROOT = Path(__file__).resolve().parents[1]


def resolve_host(host: str) -> str:
    """"node-ip" -> this Ray node's IP; anything else unchanged."""
    if host in ("node-ip", "node_ip"):
        return ray.util.get_node_ip_address()
    return host


def advertised(host: str, port: int) -> str:
    """The host:port other processes should dial for a server bound on host:port."""
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on this machine right now (small race until the server binds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


def _set_threads(num_threads: int | None) -> None:
    if num_threads:
        import torch
        torch.set_num_threads(num_threads)


class _WorkerActorBase:
    kind = ""

    def _serve(self, serve, worker, host: str, port: int) -> None:
        host = resolve_host(host)
        self.worker = worker
        self.server, self.port = serve(worker, bind_address(host, port))
        self._address = advertised(host, self.port)
        log.info("%s worker actor serving on %s", self.kind, self._address)

    def address(self) -> str:
        return self._address

    def ready(self) -> dict:
        """Called once after start-up: raises if the constructor failed; returns what is served."""
        info = self.worker.info()
        return {"kind": self.kind, "address": self._address, "pid": os.getpid(),
                "node_ip": ray.util.get_node_ip_address(), "info": asdict(info)}

    def stop(self, grace_s: float = 1.0) -> None:
        self.server.stop(grace_s).wait()


@ray.remote(max_restarts=DEFAULT_MAX_RESTARTS, max_task_retries=0)
class TargetWorkerActor(_WorkerActorBase):
    kind = "target"

    def __init__(self, model_dir: str, device: str = "cpu", dtype: str = "float32", host: str = "127.0.0.1",
                 port: int = 0, kv_cache_blocks: int | None = None, kv_block_size: int = 16,
                 num_threads: int | None = None):
        _set_threads(num_threads)
        from specdec.model.llama import LlamaModel
        from target_worker import grpc_server
        from target_worker.worker import TargetWorker

        model = LlamaModel.load(model_dir, device, dtype)
        worker = TargetWorker(model, kv_cache_blocks, kv_block_size, model_name=str(model_dir))
        self._serve(grpc_server.serve, worker, host, port)


@ray.remote(max_restarts=DEFAULT_MAX_RESTARTS, max_task_retries=0)
class DraftWorkerActor(_WorkerActorBase):
    kind = "draft"

    def __init__(self, draft: str, device: str = "cpu", dtype: str = "float32", host: str = "127.0.0.1",
                 port: int = 0, kv_cache_blocks: int | None = None, kv_block_size: int = 16,
                 num_threads: int | None = None):
        _set_threads(num_threads)
        from draft_worker import grpc_server
        from draft_worker.worker import DraftWorker, build_drafter

        if draft == "ngram":
            drafter = build_drafter("ngram")
        else:
            drafter = build_drafter(draft, device, dtype, num_blocks=kv_cache_blocks, block_size=kv_block_size)
        self._serve(grpc_server.serve, DraftWorker(drafter), host, port)


@ray.remote(max_restarts=DEFAULT_MAX_RESTARTS, max_task_retries=0, max_concurrency=4)
class CoordinatorActor:
    """Runs the public Generation server (grpc.aio, on its own thread and event loop) in the actor.

    Threaded (max_concurrency 4) so metrics_snapshot() answers while drain_and_stop() waits."""

    def __init__(self, target_address: str, draft_address: str | None, tokenizer_dir: str,
                 num_speculative_tokens: int = 5, host: str = "0.0.0.0", port: int = 50051,
                 deployment: str = "specdec", server_options: dict | None = None, max_batch_size: int = 32):
        from coordinator.embedded import build_grpc_scheduler
        from coordinator.metrics import make_round_callback
        from coordinator.server import GenerationServer, ServerThread

        self.metrics = make_round_callback(deployment)
        factory = build_grpc_scheduler(draft_address, target_address, tokenizer_dir, num_speculative_tokens,
                                       max_batch_size=max_batch_size)
        server = GenerationServer(factory, factory.tokenizer, address=bind_address(host, port),
                                  on_round=self.metrics, **(server_options or {}))
        self.handle = ServerThread(server)
        try:
            self.port = self.handle.start(wait_ready=True)  # raises if the workers cannot be reached
        except BaseException:
            self.handle.stop(0)
            raise
        self._address = advertised(host, self.port)

    def ready(self) -> dict:
        return {"kind": "coordinator", "address": self._address, "port": self.port, "pid": os.getpid(),
                "node_ip": ray.util.get_node_ip_address(), "metrics_exported": self.metrics.exporting}

    def address(self) -> str:
        return self._address

    def metrics_snapshot(self) -> dict:
        return self.metrics.snapshot()

    def drain_and_stop(self, grace_s: float = 30.0) -> dict:
        """Stop accepting requests, let in-flight ones finish (up to grace_s), stop the server."""
        self.handle.stop(grace_s)
        self.metrics.close()
        return self.metrics.snapshot()


@dataclass
class Deployment:
    """Handles to a running deployment (what `launch` returns)."""

    coordinator: "ray.actor.ActorHandle"
    target: "ray.actor.ActorHandle"
    draft: "ray.actor.ActorHandle | None"
    address: str  # the public address clients dial
    port: int
    target_address: str
    draft_address: str | None
    startup_seconds: float = 0.0
    info: dict = field(default_factory=dict)

    def actors(self) -> list:
        return [a for a in (self.coordinator, self.draft, self.target) if a is not None]

    def drain_and_stop(self, grace_s: float = 30.0, timeout_s: float | None = None) -> dict | None:
        """Drain the public server, stop the workers' gRPC servers, then kill all actors."""
        snapshot = None
        try:
            snapshot = ray.get(self.coordinator.drain_and_stop.remote(grace_s),
                               timeout=timeout_s if timeout_s is not None else grace_s + 15)
        except Exception as e:  # noqa: BLE001 - still tear the rest down
            log.warning("coordinator did not drain cleanly: %s", e)
        workers = [a for a in (self.draft, self.target) if a is not None]
        try:
            ray.get([a.stop.remote(1.0) for a in workers], timeout=10)
        except Exception as e:  # noqa: BLE001
            log.warning("workers did not stop cleanly: %s", e)
        self.kill()
        return snapshot

    def kill(self) -> None:
        for actor in self.actors():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass


def _resources(device: str, gpus: float | None, cpus: float) -> dict:
    opts = {"num_cpus": cpus}
    if device.startswith("cuda"):
        opts["num_gpus"] = 1 if gpus is None else gpus
    return opts


def launch(target: str, draft: str | None = None, *, num_speculative_tokens: int = 5,
           host: str = "0.0.0.0", port: int = 50051, device: str = "cpu", dtype: str = "float32",
           worker_host: str = "127.0.0.1", target_port: int | None = None, draft_port: int | None = None,
           name_prefix: str = "specdec", namespace: str = NAMESPACE, server_options: dict | None = None,
           kv_cache_blocks: int | None = None, kv_block_size: int = 16, target_gpus: float | None = None,
           draft_gpus: float | None = None, worker_cpus: float = 1, target_threads: int | None = None,
           draft_threads: int | None = None, max_batch_size: int = 32, max_restarts: int = DEFAULT_MAX_RESTARTS,
           pin_coordinator: bool = True, timeout_s: float = 600.0) -> Deployment:
    """Start target (+ draft) worker actors and the coordinator actor; wait until all are ready.

    `draft`: a checkpoint directory, "ngram", or None (target only). The coordinator (the public
    port) is pinned to the caller's node unless pin_coordinator is False, so `specdec serve` on the
    head node opens the public port there. Worker ports left as None
    are picked here when the workers bind loopback (then they survive a restart), else 0 (any).
    Raises RuntimeError with the failing actor's error if start-up fails (all actors are killed).
    """
    t0 = time.perf_counter()
    local_host = worker_host in ("127.0.0.1", "localhost", "::1")
    if target_port is None:
        target_port = free_port(worker_host) if local_host else 0
    if draft_port is None:
        draft_port = free_port(worker_host) if local_host and draft else 0
    common = dict(namespace=namespace, max_restarts=max_restarts, max_task_retries=0, lifetime="non_detached")
    worker_args = dict(device=device, dtype=dtype, host=worker_host, kv_cache_blocks=kv_cache_blocks,
                       kv_block_size=kv_block_size)
    started = []
    try:
        target_actor = TargetWorkerActor.options(
            name=f"{name_prefix}-target", **common, **_resources(device, target_gpus, worker_cpus),
        ).remote(str(target), port=target_port, num_threads=target_threads, **worker_args)
        started.append(target_actor)
        draft_actor = None
        if draft:
            draft_device = "cpu" if draft == "ngram" else device
            draft_actor = DraftWorkerActor.options(
                name=f"{name_prefix}-draft", **common, **_resources(draft_device, draft_gpus, worker_cpus),
            ).remote(str(draft), port=draft_port, num_threads=draft_threads, **{**worker_args, "device": draft_device})
            started.append(draft_actor)
        # Both load their models concurrently; a constructor error surfaces here.
        infos = ray.get([a.ready.remote() for a in started], timeout=timeout_s)
        target_info = infos[0]
        draft_info = infos[1] if draft_actor is not None else None
        if draft_info is not None:
            dv, tv = draft_info["info"].get("vocab_size"), target_info["info"]["vocab_size"]
            if dv is not None and dv != tv:
                raise ValueError(f"draft vocabulary ({dv}) differs from the target's ({tv}): "
                                 "they must share a tokenizer")
        placement = {}
        if pin_coordinator:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
            placement["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                node_id=ray.get_runtime_context().get_node_id(), soft=False)
        coordinator = CoordinatorActor.options(
            name=f"{name_prefix}-coordinator", num_cpus=0, **common, **placement,
        ).remote(target_info["address"], draft_info["address"] if draft_info else None, str(target),
                 num_speculative_tokens, host, port, name_prefix, server_options, max_batch_size)
        started.append(coordinator)
        coord_info = ray.get(coordinator.ready.remote(), timeout=timeout_s)
    except BaseException as e:
        for actor in started:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise RuntimeError(_explain_start_error(e)) from e
    return Deployment(coordinator=coordinator, target=target_actor, draft=draft_actor,
                      address=coord_info["address"], port=coord_info["port"],
                      target_address=target_info["address"],
                      draft_address=draft_info["address"] if draft_info else None,
                      startup_seconds=time.perf_counter() - t0,
                      info={"target": target_info, "draft": draft_info, "coordinator": coord_info})


def _explain_start_error(e: BaseException) -> str:
    """The root cause of a failed actor start, without Ray's long wrapper text if possible."""
    cause = getattr(e, "cause", None) or getattr(e, "__cause__", None)
    if isinstance(e, ValueError) and "already taken" in str(e):
        return f"{e} (another specdec deployment with the same name runs in this Ray cluster)"
    if cause is not None and not isinstance(cause, type(e)):
        return f"{type(cause).__name__}: {cause}"
    text = str(e)
    return text if len(text) < 4000 else text[-4000:]
