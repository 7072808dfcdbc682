"""Continuous batching and the speculation round loop.

Each `step()` is one round over every running request: one call to the draft worker, one to the
target worker. Requests join and leave between rounds. The scheduler knows token ids, lengths and
limits, never model internals.
"""
from __future__ import annotations

import time
from collections import deque

from coordinator.clients import DraftClient, TargetClient
from coordinator.request import Request, RequestStats, RequestUpdate, RunningRequest
from coordinator.text_stream import TextStream
from specdec.round_types import DraftProposal, DraftTask, VerifyTask


class Scheduler:
    def __init__(self, target: TargetClient, draft: DraftClient | None = None, tokenizer=None,
                 num_speculative_tokens: int = 5, max_batch_size: int = 32):
        if num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.default_k = num_speculative_tokens
        self.max_batch_size = max_batch_size
        self.target_info = target.info()
        self.draft_info = draft.info() if draft is not None else None
        limits = [self.target_info.max_seq_len]
        if self.draft_info is not None and self.draft_info.max_seq_len:
            limits.append(self.draft_info.max_seq_len)
        self.max_seq_len = min(limits)
        self.eos_ids = set(self.target_info.eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: dict[str, RunningRequest] = {}
        self._release_draft: list[str] = []
        self._release_target: list[str] = []
        self._reserved_blocks: dict[str, int] = {}
        # After a failed release (worker down) wait before retrying, instead of spinning on it.
        self._release_retry_at = 0.0
        self.kv_blocks_used = 0
        self.total_rounds = 0
        self.last_round_seconds = {"draft": 0.0, "verify": 0.0}

    # -- admission ------------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        """Raise ValueError with a message a user can act on."""
        request.params.validate()
        if request.params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none: use max_new_tokens or EOS")
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.target_info.vocab_size
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        total = len(request.prompt_ids) + request.params.max_new_tokens
        if total > self.max_seq_len:
            raise ValueError(f"prompt ({len(request.prompt_ids)} tokens) + max_new_tokens "
                             f"({request.params.max_new_tokens}) = {total} exceeds the context length {self.max_seq_len}")
        k = request.num_speculative_tokens
        if k is not None and not 0 <= k <= 64:
            raise ValueError(f"num_speculative_tokens must be between 0 and 64, got {k}")
        if request.req_id in self.running or any(r.req_id == request.req_id for r in self.waiting):
            raise ValueError(f"request id {request.req_id!r} is already in use")
        if self._blocks_for(request) > self.target_info.kv_blocks_total:
            raise ValueError(f"the request needs {self._blocks_for(request)} KV blocks but the cache has "
                             f"{self.target_info.kv_blocks_total}")

    def add_request(self, request: Request) -> None:
        self.validate(request)
        self.waiting.append(request)

    def abort(self, req_id: str) -> bool:
        """Drop a request now (client gone); its KV blocks are freed at the start of the next round."""
        for i, r in enumerate(self.waiting):
            if r.req_id == req_id:
                del self.waiting[i]
                return True
        if req_id in self.running:
            self._retire(req_id)
            return True
        return False

    def has_work(self) -> bool:
        releases_due = (self._release_target or self._release_draft) and time.monotonic() >= self._release_retry_at
        return bool(self.waiting or self.running or releases_due)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def _blocks_for(self, request: Request) -> int:
        # Worst case the target holds prompt + max_new_tokens tokens (k is capped to fit).
        block = self.target_info.kv_block_size
        return -(-(len(request.prompt_ids) + request.params.max_new_tokens) // block) + 1

    def _admit(self) -> None:
        free = self.target_info.kv_blocks_total - sum(self._reserved_blocks.values())
        while self.waiting and len(self.running) < self.max_batch_size:
            request = self.waiting[0]
            need = self._blocks_for(request)
            if need > free:
                break  # first come, first served: wait for blocks rather than starve big requests
            self.waiting.popleft()
            free -= need
            self._reserved_blocks[request.req_id] = need
            spec_k = self.default_k if request.num_speculative_tokens is None else request.num_speculative_tokens
            if self.draft is None:
                spec_k = 0
            run = RunningRequest(request=request, spec_k=spec_k,
                                 stream=TextStream(self.tokenizer, request.params.stop))
            run.stats.prompt_tokens = len(request.prompt_ids)
            run.stats.has_draft = spec_k > 0
            run.unsent_to_draft = list(request.prompt_ids)
            self.running[request.req_id] = run

    def _retire(self, req_id: str) -> None:
        run = self.running.pop(req_id)
        self._reserved_blocks.pop(req_id, None)
        if run.started_target:
            self._release_target.append(req_id)
        if run.spec_k > 0:
            self._release_draft.append(req_id)

    # -- the round --------------------------------------------------------------------------
    def _round_k(self, run: RunningRequest) -> int:
        """Draft length this round: shrinks near max_new_tokens and the context end, so a round
        never overflows and always commits at least one token."""
        length = len(run.request.prompt_ids) + len(run.generated)
        remaining = run.request.params.max_new_tokens - len(run.generated)
        return max(0, min(run.spec_k, remaining - 1, self.max_seq_len - length - 1))

    def step(self) -> list[RequestUpdate]:
        updates = self._expire_deadlines()
        self._admit()
        if not self.running:
            self._flush_releases()
            return updates
        runs = list(self.running.values())
        ks = {r.request.req_id: self._round_k(r) for r in runs}
        try:
            proposals = self._draft_round(runs, ks)
            t0 = time.perf_counter()
            tasks = []
            for run in runs:
                req_id = run.request.req_id
                proposal = proposals.get(req_id)
                tasks.append(VerifyTask(
                    req_id=req_id,
                    new_tokens=[] if run.started_target else list(run.request.prompt_ids),
                    draft_tokens=proposal.tokens if proposal else [],
                    q=proposal.q if proposal else None,
                    params=run.request.params))
            finished, self._release_target = self._release_target, []
            try:
                result = self.target.verify(tasks, finished)
            except Exception:
                # The releases may not have reached the worker: send them again next round
                # (workers ignore ids they do not know, e.g. after a restart).
                self._release_target = finished + self._release_target
                raise
            self.last_round_seconds["verify"] = time.perf_counter() - t0
        except Exception as exc:  # a worker failed: end this round's requests, keep serving
            return updates + self._fail_all(runs, exc)
        self.total_rounds += 1
        self.kv_blocks_used = result.kv_blocks_used
        for run in runs:
            run.started_target = True
        for outcome in result.outcomes:
            run = self.running[outcome.req_id]
            proposal = proposals.get(outcome.req_id)
            run.stats.rounds += 1
            if proposal is not None:
                run.stats.proposed += len(proposal.tokens)
                run.stats.draft_forward_passes += proposal.draft_forward_passes
            run.stats.accepted += outcome.num_accepted
            updates.append(self._commit(run, outcome.tokens))
        return updates

    def _draft_round(self, runs: list[RunningRequest], ks: dict[str, int]) -> dict[str, DraftProposal]:
        t0 = time.perf_counter()
        tasks = []
        for run in runs:
            if run.spec_k == 0:
                continue
            tasks.append(DraftTask(req_id=run.request.req_id, new_tokens=run.unsent_to_draft,
                                   k=ks[run.request.req_id], params=run.request.params))
            run.unsent_to_draft = []
        finished, self._release_draft = self._release_draft, []
        if self.draft is None or not (tasks or finished):
            self.last_round_seconds["draft"] = 0.0
            return {}
        try:
            proposals = self.draft.propose(tasks, finished)
        except Exception:
            self._release_draft = finished + self._release_draft
            raise
        self.last_round_seconds["draft"] = time.perf_counter() - t0
        return {p.req_id: p for p in proposals}

    def _commit(self, run: RunningRequest, tokens: list[int]) -> RequestUpdate:
        """Apply stop conditions to the committed tokens, in order, and build the update."""
        params = run.request.params
        reason = None
        kept = []
        for token in tokens:
            kept.append(token)
            if len(run.generated) + len(kept) >= params.max_new_tokens:
                reason = "length"
            if token in self.eos_ids and not params.ignore_eos:
                reason = "eos"
            if reason:
                break
        kept, text, stop_hit = run.stream.add(kept)
        if stop_hit:
            reason = "stop"
        run.generated.extend(kept)
        run.unsent_to_draft.extend(kept)
        run.stats.generated = len(run.generated)
        update = RequestUpdate(req_id=run.request.req_id, token_ids=kept, text=text)
        if reason:
            update.text += run.stream.finish() if reason != "stop" else ""
            update.finished, update.finish_reason, update.stats = True, reason, run.stats
            self._retire(run.request.req_id)
        return update

    def _expire_deadlines(self) -> list[RequestUpdate]:
        now = time.monotonic()
        updates = []
        for req in [r for r in self.waiting if r.deadline is not None and r.deadline <= now]:
            self.waiting.remove(req)
            updates.append(RequestUpdate(req_id=req.req_id, token_ids=[], text="", finished=True,
                                         finish_reason="deadline", stats=RequestStats(prompt_tokens=len(req.prompt_ids)),
                                         error="deadline exceeded before the request started", error_kind="deadline"))
        for run in [r for r in self.running.values() if r.request.deadline is not None and r.request.deadline <= now]:
            self._retire(run.request.req_id)
            updates.append(RequestUpdate(req_id=run.request.req_id, token_ids=[], text=run.stream.finish(),
                                         finished=True, finish_reason="deadline", stats=run.stats,
                                         error="deadline exceeded", error_kind="deadline"))
        return updates

    def _fail_all(self, runs: list[RunningRequest], exc: Exception) -> list[RequestUpdate]:
        kind = "unavailable" if type(exc).__name__ == "WorkerUnavailable" else "internal"
        updates = []
        for run in runs:
            # The target may have admitted the request before failing: release it to be sure
            # (workers ignore ids they do not know).
            run.started_target = True
            self._retire(run.request.req_id)
            updates.append(RequestUpdate(req_id=run.request.req_id, token_ids=[], text="", finished=True,
                                         finish_reason="error", stats=run.stats,
                                         error=f"{type(exc).__name__}: {exc}", error_kind=kind))
        return updates

    def _flush_releases(self) -> None:
        """Free the cache of retired requests even when nothing else is running."""
        if self._release_draft and self.draft is not None:
            finished, self._release_draft = self._release_draft, []
            try:
                self.draft.propose([], finished)
            except Exception:
                self._release_draft = finished + self._release_draft
                self._release_retry_at = time.monotonic() + 1.0
        if self._release_target:
            finished, self._release_target = self._release_target, []
            try:
                self.kv_blocks_used = self.target.verify([], finished).kv_blocks_used
            except Exception:
                self._release_target = finished + self._release_target
                self._release_retry_at = time.monotonic() + 1.0
