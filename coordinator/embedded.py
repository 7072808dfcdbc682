"""Scheduler factories for the GenerationServer: in-process workers, or workers over gRPC.

A factory is called once, in the engine thread, so model loading and connecting to workers
never block the server's event loop (health stays NOT_SERVING meanwhile).
"""
from __future__ import annotations

from typing import Callable

from coordinator.scheduler import Scheduler
from specdec.tokenizer import load_tokenizer


class LocalSchedulerFactory:
    """Builds the target (and draft) workers in this process; keeps them as attributes so tests
    and metrics can look at their caches after the call."""

    def __init__(self, target_dir: str, draft: str | None, num_speculative_tokens: int, device: str,
                 dtype: str, max_batch_size: int, kv_cache_blocks: int | None, kv_block_size: int):
        self.target_dir, self.draft = str(target_dir), (str(draft) if draft is not None else None)
        self.num_speculative_tokens = num_speculative_tokens
        self.device, self.dtype = device, dtype
        self.max_batch_size = max_batch_size
        self.kv_cache_blocks, self.kv_block_size = kv_cache_blocks, kv_block_size
        self.target_worker = None
        self.draft_worker = None

    def __call__(self) -> Scheduler:
        from coordinator.clients import LocalDraftClient, LocalTargetClient
        from coordinator.engine import build_local_workers

        self.target_worker, self.draft_worker = build_local_workers(
            self.target_dir, self.draft, self.device, self.dtype, self.kv_cache_blocks, self.kv_block_size)
        # Its own tokenizer instance: the scheduler decodes in the engine thread while the server
        # encodes prompts on the event loop, and HF fast tokenizers are not safe to share that way.
        return Scheduler(LocalTargetClient(self.target_worker),
                         LocalDraftClient(self.draft_worker) if self.draft_worker else None,
                         load_tokenizer(self.target_dir), self.num_speculative_tokens, self.max_batch_size)


def build_local_scheduler(target_dir: str, draft: str | None = None, num_speculative_tokens: int = 5,
                          device: str = "cpu", dtype: str = "float32", max_batch_size: int = 32,
                          kv_cache_blocks: int | None = None, kv_block_size: int = 16
                          ) -> tuple[LocalSchedulerFactory, object]:
    """(scheduler_factory, tokenizer) for the embedded service: everything in one process.

    `draft` is None (target only), "ngram" or a draft checkpoint directory; the tokenizer is the
    one saved with the target (None if it has none: prompts must then be token ids).
    """
    factory = LocalSchedulerFactory(target_dir, draft, num_speculative_tokens, device, dtype, max_batch_size,
                                    kv_cache_blocks, kv_block_size)
    return factory, load_tokenizer(target_dir)


class GrpcSchedulerFactory:
    """Connects to running workers. `.tokenizer` is a tokenizer for the server to encode with."""

    def __init__(self, draft_address: str | None, target_address: str, tokenizer_dir: str | None,
                 num_speculative_tokens: int, max_batch_size: int, connect_timeout_s: float):
        self.draft_address, self.target_address = draft_address, target_address
        self.tokenizer_dir = tokenizer_dir
        self.num_speculative_tokens = num_speculative_tokens
        self.max_batch_size = max_batch_size
        self.connect_timeout_s = connect_timeout_s
        self.tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
        self.target_client = None
        self.draft_client = None

    def __call__(self) -> Scheduler:
        from coordinator.grpc_clients import GrpcDraftClient, GrpcTargetClient

        target = GrpcTargetClient(self.target_address)
        draft = GrpcDraftClient(self.draft_address) if self.draft_address else None
        try:
            for client in (target, draft):
                if client is not None:
                    client.wait_ready(self.connect_timeout_s)
            target_info = target.info(self.connect_timeout_s)
            if draft is not None:
                draft_vocab = draft.info(self.connect_timeout_s).vocab_size
                if draft_vocab is not None and draft_vocab != target_info.vocab_size:
                    raise ValueError(f"draft vocabulary ({draft_vocab}) differs from the target's "
                                     f"({target_info.vocab_size}): they must share a tokenizer")
            scheduler = Scheduler(target, draft, load_tokenizer(self.tokenizer_dir) if self.tokenizer_dir else None,
                                  self.num_speculative_tokens, self.max_batch_size)
        except BaseException:
            for client in (target, draft):
                if client is not None:
                    client.close()
            raise
        self.target_client, self.draft_client = target, draft
        return scheduler


def build_grpc_scheduler(draft_address: str | None, target_address: str, tokenizer_dir: str | None = None,
                         num_speculative_tokens: int = 5, max_batch_size: int = 32,
                         connect_timeout_s: float = 60.0) -> Callable[[], Scheduler]:
    """A scheduler_factory whose scheduler drives remote workers over gRPC (no draft if
    draft_address is None). The returned factory's `.tokenizer` (loaded from tokenizer_dir, the
    target checkpoint or any directory with the same tokenizer) is what the server should encode
    prompts with; the scheduler gets its own instance for detokenization."""
    return GrpcSchedulerFactory(draft_address, target_address, tokenizer_dir, num_speculative_tokens,
                                max_batch_size, connect_timeout_s)
