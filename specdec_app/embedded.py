"""Scheduler factories for the GenerationServer and LocalEngine: in-process workers, or workers
reached over gRPC.

A factory is called once, on the scheduler's thread, so model loading and connecting to workers
never block the server's event loop (health stays NOT_SERVING meanwhile). Each factory also holds
`tokenizer`, the instance the server encodes prompts with (the scheduler decodes with its own:
Hugging Face fast tokenizers are not safe to share across threads), and `wire`, the byte counters
of its gRPC clients (empty in process).
"""
from __future__ import annotations

from coordinator.rounds.clients import DraftClient, TargetClient
from coordinator.rounds.grpc_clients import GrpcDraftClient, GrpcTargetClient, WireCounter
from coordinator.rounds.scheduler import Scheduler
from draft_worker.worker import DraftWorker
from specdec.config import NGRAM, ServiceConfig
from specdec.tokenizer import load_tokenizer
from target_worker.worker import TargetWorker


def build_scheduler(config: ServiceConfig, target: TargetClient, draft: DraftClient | None) -> Scheduler:
    """A Scheduler on these workers (the adaptive policy learns what rounds cost as they run)."""
    return Scheduler(target, draft, load_tokenizer(config.target.model), config.scheduler)


class LocalSchedulerFactory:
    """Builds the target (and draft) workers in this process; keeps them as attributes so tests
    and the load test can audit their caches."""

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.tokenizer = load_tokenizer(config.target.model)
        self.wire: dict[str, WireCounter] = {}
        self.target_worker: TargetWorker | None = None
        self.draft_worker: DraftWorker | None = None

    def __call__(self) -> Scheduler:
        self.target_worker = TargetWorker.from_config(self.config.target)
        self.draft_worker = DraftWorker.from_config(self.config.draft)
        return build_scheduler(self.config, self.target_worker, self.draft_worker)

    def close(self) -> None:
        pass


class GrpcSchedulerFactory:
    """Drives workers already serving at target_address / draft_address. Without a draft address
    the n-gram drafter (if configured) runs here, in the coordinator: it needs no worker."""

    def __init__(self, config: ServiceConfig, target_address: str, draft_address: str | None,
                 connect_timeout_s: float = 60.0):
        self.config = config
        self.connect_timeout_s = connect_timeout_s
        self.tokenizer = load_tokenizer(config.target.model)
        timeout = config.scheduler.worker_round_timeout
        self.target_client = GrpcTargetClient(target_address, timeout)
        self.draft_client = GrpcDraftClient(draft_address, timeout) if draft_address else None
        self.wire = {"target": self.target_client.wire}
        if self.draft_client is not None:
            self.wire["draft"] = self.draft_client.wire
        self.local_draft = DraftWorker.from_config(config.draft) if not draft_address and config.draft.kind == NGRAM \
            else None

    def _clients(self) -> list:
        return [c for c in (self.target_client, self.draft_client) if c is not None]

    def __call__(self) -> Scheduler:
        try:
            for client in self._clients():
                client.wait_ready(self.connect_timeout_s)
            return build_scheduler(self.config, self.target_client, self.draft_client or self.local_draft)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for client in self._clients():
            client.close()


class LocalReplicaLauncher:
    """Autoscaling without Ray (coordinator.replicas.router.ReplicaLauncher): a replica added is one more
    set of workers in this process; removing it drops them with its scheduler."""

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.factories: dict[int, LocalSchedulerFactory] = {}

    def add(self, index: int) -> LocalSchedulerFactory:
        self.factories[index] = LocalSchedulerFactory(self.config)
        return self.factories[index]

    def remove(self, index: int) -> None:
        self.factories.pop(index, None)
