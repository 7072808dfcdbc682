"""Admission and KV reservation: which requests wait, and when one may start running.

A request waits (new, or `adopted`: moved here from another replica with its committed tokens)
until it fits: each running request holds a reservation of the target's KV blocks for its worst
case (prompt + max_new_tokens, K capped to fit), so a round never runs out of cache. Adopted
requests start first (they were admitted once already); then new ones, first come first served:
a big request at the head waits for blocks rather than be starved by small ones behind it.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque

from coordinator.rounds.request import Request, RequestStats, RunningRequest
from coordinator.rounds.round_report import RequestUpdate
from coordinator.rounds.text_stream import TextStream
from specdec.config import SchedulerConfig
from specdec.kv_cache import blocks_for_tokens
from specdec.round_types import TargetInfo
from specdec.sampling import random_seed
from specdec.sampling.tree import tree_size


class Admission:
    def __init__(self, config: SchedulerConfig, target: TargetInfo, max_seq_len: int, tokenizer, drafting: bool):
        """`drafting`: a drafter exists (else every request runs at K = 0)."""
        self.config, self.target, self.max_seq_len = config, target, max_seq_len
        self.tokenizer, self.drafting = tokenizer, drafting
        self.waiting: deque[Request] = deque()
        self.adopted: deque[tuple[RunningRequest, object]] = deque()  # moved here, not yet running
        self.reserved: dict[str, int] = {}  # KV blocks each running request holds

    @property
    def queue_depth(self) -> int:
        return len(self.waiting) + len(self.adopted)

    def knows(self, req_id: str) -> bool:
        return any(r.req_id == req_id for r in self.waiting) or any(
            run.request.req_id == req_id for run, _ in self.adopted)

    def validate(self, request: Request) -> None:
        """Raise ValueError with a message a user can act on."""
        request.params.validate()
        if request.params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none: use max_new_tokens or EOS")
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.target.vocab_size
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        total = len(request.prompt_ids) + request.params.max_new_tokens
        if total > self.max_seq_len:
            raise ValueError(f"prompt ({len(request.prompt_ids)} tokens) + max_new_tokens "
                             f"({request.params.max_new_tokens}) = {total} exceeds the context length "
                             f"{self.max_seq_len}")
        asked, most = request.num_speculative_tokens, self.config.max_request_speculative_tokens
        if asked is not None and not 0 <= asked <= most:
            raise ValueError(f"num_speculative_tokens must be between 0 and {most}, got {asked}")
        if self.blocks_for(request) > self.target.kv_blocks_total:
            raise ValueError(f"the request needs {self.blocks_for(request)} KV blocks but the cache has "
                             f"{self.target.kv_blocks_total}")

    def add(self, request: Request) -> None:
        """Queue a validated request, its seed fixed here: its randomness is a function of its seed
        (specdec.sampling.random), held by the coordinator, so both workers and any restarted one
        use the same draws."""
        request.client_seed = request.params.seed is not None
        if request.params.seed is None:
            request.params = dataclasses.replace(request.params, seed=random_seed())
        self.waiting.append(request)

    def adopt(self, moved: Request | RunningRequest, policy_state: object = None) -> None:
        """Queue a request another scheduler admitted (its seed fixed there); a running one comes
        with its committed tokens, fed again here as one prompt."""
        if isinstance(moved, Request):
            self.waiting.append(moved)
            return
        moved.started_target = False
        moved.unsent_to_draft = moved.request.prompt_ids + moved.generated  # this draft has none of it
        moved.stream.tokenizer = self.tokenizer  # tokenizers are not shared across threads
        if not self.drafting:
            moved.num_speculative_tokens = 0
        self.adopted.append((moved, policy_state))

    def take(self, req_id: str) -> tuple[Request | RunningRequest, object] | None:
        """Remove a request that has not started here: (it, its policy state), or None."""
        for i, r in enumerate(self.waiting):
            if r.req_id == req_id:
                del self.waiting[i]
                return r, None
        for i, (run, state) in enumerate(self.adopted):
            if run.request.req_id == req_id:
                del self.adopted[i]
                return run, state
        return None

    def blocks_for(self, request: Request) -> int:
        # Worst case the target holds prompt + max_new_tokens tokens (K is capped to fit), and
        # while it verifies a tree, the other branches' nodes too.
        tokens = len(request.prompt_ids) + request.params.max_new_tokens
        if self.drafting and self.config.tree_branches > 1:
            asked = request.num_speculative_tokens
            k = self.config.num_speculative_tokens if asked is None else asked
            tokens += tree_size(k, self.config.tree_branches, self.config.tree_side_depth) - k
        return blocks_for_tokens(tokens, self.target.kv_block_size) + 1

    def admit(self, running: dict[str, RunningRequest]) -> list[tuple[str, object]]:
        """Start what fits into `running`; returns (req_id, policy state) of adopted requests that
        brought one."""
        free = self.target.kv_blocks_total - sum(self.reserved.values())
        adopted_states = []
        while self.adopted and len(running) < self.config.max_batch_size:  # they were admitted before
            run, state = self.adopted[0]
            need = self.blocks_for(run.request)
            if need > free:
                return adopted_states
            self.adopted.popleft()
            free -= need
            self.reserved[run.request.req_id] = need
            running[run.request.req_id] = run
            if state is not None:
                adopted_states.append((run.request.req_id, state))
        while self.waiting and len(running) < self.config.max_batch_size:
            request = self.waiting[0]
            need = self.blocks_for(request)
            if need > free:
                break  # first come, first served: wait for blocks rather than starve big requests
            self.waiting.popleft()
            free -= need
            self.reserved[request.req_id] = need
            running[request.req_id] = self._start(request)
        return adopted_states

    def _start(self, request: Request) -> RunningRequest:
        asked = request.num_speculative_tokens
        speculative = (self.config.num_speculative_tokens if asked is None else asked) if self.drafting else 0
        run = RunningRequest(request=request, num_speculative_tokens=speculative,
                             stream=TextStream(self.tokenizer, request.params.stop))
        run.stats.prompt_tokens = len(request.prompt_ids)
        run.stats.has_draft = speculative > 0
        run.unsent_to_draft = list(request.prompt_ids)
        return run

    def expire(self) -> list[RequestUpdate]:
        """End the waiting requests whose deadline passed."""
        now = time.monotonic()
        late = [r for r in self.waiting if r.deadline is not None and r.deadline <= now]
        for request in late:
            self.waiting.remove(request)
        return [RequestUpdate.failure(r.req_id, "deadline exceeded before the request started", "deadline",
                                      stats=RequestStats(prompt_tokens=len(r.prompt_ids))) for r in late]
