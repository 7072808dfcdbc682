"""A target and a draft worker served over gRPC on fixed loopback ports, each of which a test can
kill (its server stops and its state is gone, as when the process dies) and start fresh on the same
port (as Ray restarts it), with a scheduler driving them; the resume tests' models and requests.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from types import SimpleNamespace

from coordinator.rounds.grpc_clients import GrpcDraftClient, GrpcTargetClient
from coordinator.rounds.scheduler import Scheduler
from draft_worker import grpc_server as draft_server
from draft_worker.worker import DraftWorker
from specdec import ServiceConfig
from specdec.params import SamplingParams
from specdec_app.ray_cluster import free_port
from target_worker import grpc_server as target_server
from target_worker.worker import TargetWorker

from checkpoints import CONFIGS, build_checkpoint, perturbed_copy, predraft_always

PROMPTS = [[3, 17, 42, 7, 99, 12, 5], [8, 8, 8, 21, 30, 8, 8, 8, 21], [150, 4], list(range(40, 60))]
GREEDY = SamplingParams(max_new_tokens=30, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=30, temperature=0.9, seed=77, ignore_eos=True)
PARAMS = [GREEDY, SEEDED, dataclasses.replace(SEEDED, seed=2**64 - 2, top_k=30), GREEDY]


def resume_models(tmp_path_factory) -> tuple[str, str]:
    """(target, draft): a random target and a perturbed copy of it."""
    target = build_checkpoint(tmp_path_factory.mktemp("resume-target"), seed=0, initializer_range=0.1,
                              **CONFIGS["gqa_untied"])
    draft = perturbed_copy(target, tmp_path_factory.mktemp("resume-draft"), noise=0.2)
    return str(target), str(draft)


class ServedWorker:
    """A worker behind gRPC on a fixed port that can be killed and restarted fresh."""

    def __init__(self, build, serve):
        self.build, self.serve = build, serve
        self.port = free_port()
        self.server = None
        self.start()

    def start(self) -> None:
        self.worker = self.build()
        self.server, _ = self.serve(self.worker, f"127.0.0.1:{self.port}")

    def kill(self) -> None:
        self.server.stop(None).wait()
        self.worker = None  # its state (KV cache, sequences) is gone

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def served_cluster(models, overlap: bool) -> Iterator[SimpleNamespace]:
    """Both workers served, and a scheduler on gRPC clients of them (config, target, draft,
    scheduler); stopped when the generator is closed. For a pytest fixture to yield from."""
    # K fixed (every round drafts, so a lost draft is noticed at once); see also the adaptive case.
    # Serial and overlapped rounds (a pre-draft beside every verify, so a kill hits one in flight).
    config = ServiceConfig.from_settings(target=models[0], draft=models[1], num_speculative_tokens=4,
                                         adaptive=False, kv_cache_blocks=128, kv_block_size=8,
                                         worker_round_timeout=2.0, worker_recovery_timeout=30.0,
                                         overlap=overlap)
    target = ServedWorker(lambda: TargetWorker.from_config(config.target), target_server.serve)
    draft = ServedWorker(lambda: DraftWorker.from_config(config.draft), draft_server.serve)
    clients = [GrpcTargetClient(target.address, 2.0), GrpcDraftClient(draft.address, 2.0)]
    sched = Scheduler(clients[0], clients[1], None, config.scheduler)
    if overlap:
        predraft_always(sched)
    yield SimpleNamespace(config=config, target=target, draft=draft, scheduler=sched)
    for client in clients:
        client.close()
    for worker in (target, draft):
        if worker.server is not None:
            worker.server.stop(None)
