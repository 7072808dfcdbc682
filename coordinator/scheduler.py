"""Continuous batching and the speculation round loop.

Each `step()` is one round over every running request: one call to the draft worker, one to the
target worker, and a `RoundReport` of what it did. Requests join and leave between rounds. The
scheduler knows token ids, lengths and limits, never model internals.

A worker that stops answering costs its requests a pause, not their output: the scheduler holds
every committed token. When the target is lost, each request is released there and re-admitted
with its prompt plus the tokens committed so far (a fresh first round) once the target answers
again; when the draft is lost, rounds go on without speculation, except seeded sampled requests,
which wait for it (K = 0 rounds would decide their tokens with other random draws than an
uninterrupted run). Only a worker gone longer than worker_recovery_timeout, or one that will not
be restarted (WorkerGone), fails its requests; `healthy` is False while the target is in that state.
A lost target is probed even when no request runs, so an idle replica learns it is back.

With several replicas (coordinator.router) a request can also move: `evict` takes it out of this
scheduler with its committed tokens, stream and policy state, and another replica's scheduler
`adopt`s it, re-feeding prompt + committed tokens as a fresh first round, exactly as after a lost
target: the same tokens follow.

Overlapped drafting (config.overlap): beside each verify call the draft gets a pre-draft task
(coordinator.predraft) on a one-thread executor, so both workers compute at once; its result is
collected before step() returns, so nothing is in flight between steps (a request may be aborted
or a worker lost between them) and the work a step does depends on the tokens, never on timing.
A pre-draft is used only when the verdict committed exactly what it assumed.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from coordinator.clients import DraftClient, TargetClient
from coordinator.errors import WorkerUnavailable
from coordinator.predraft import PreDraft, concat_proposals
from coordinator.predraft_gate import PreDraftGate
from coordinator.request import Request, RequestStats, RunningRequest
from coordinator.round_costs import RoundCosts
from coordinator.round_report import RequestUpdate, RoundReport
from coordinator.speculation_policy import PolicyRequest, SpeculationPolicy
from coordinator.text_stream import TextStream
from coordinator.worker_health import WorkerHealth
from specdec.config import SchedulerConfig
from specdec.kv_cache import blocks_for_tokens
from specdec.round_types import DraftInfo, DraftProposal, DraftTask, TargetInfo, VerifyTask
from specdec.sampling import random_seed


def reference_draft_cost(target: TargetInfo, draft: DraftInfo | None) -> float:
    """A draft step's cost in target steps, from the models' sizes alone (machine-independent, so
    seeded requests can use it): 0 for the n-gram drafter."""
    parameters = (draft.extra or {}).get("parameters") if draft is not None else None
    if not parameters or not target.num_parameters:
        return 0.0
    return parameters / target.num_parameters


class Scheduler:
    def __init__(self, target: TargetClient, draft: DraftClient | None, tokenizer, config: SchedulerConfig):
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.config = config
        self.target_info = target.info()
        self.draft_info = draft.info() if draft is not None else None
        draft_vocab = self.draft_info.vocab_size if self.draft_info is not None else None
        if draft_vocab is not None and draft_vocab != self.target_info.vocab_size:
            raise ValueError(f"draft vocabulary ({draft_vocab}) differs from the target's "
                             f"({self.target_info.vocab_size}): they must share a tokenizer")
        limits = [self.target_info.max_seq_len]
        if self.draft_info is not None and self.draft_info.max_seq_len:
            limits.append(self.draft_info.max_seq_len)
        self.max_seq_len = min(limits)
        self.eos_ids = set(self.target_info.eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.adopted: deque[tuple[RunningRequest, object]] = deque()  # moved here, not yet running
        self.running: dict[str, RunningRequest] = {}
        self._release_draft: list[str] = []
        self._release_target: list[str] = []
        self._reserved_blocks: dict[str, int] = {}
        # After a failed release (worker down) wait before retrying, instead of spinning on it.
        self._release_retry_at = 0.0
        self.kv_blocks_used = 0
        self.target_health = WorkerHealth("target", config.worker_recovery_timeout)
        self.draft_health = WorkerHealth("draft", config.worker_recovery_timeout)
        self.policy: SpeculationPolicy | None = None
        if config.adaptive and draft is not None and config.num_speculative_tokens > 0:
            k = config.num_speculative_tokens
            costs = RoundCosts(max_fed=config.max_batch_size * (k + 1), max_steps=k)  # learnt as rounds run
            self.policy = SpeculationPolicy(costs, reference_draft_cost(self.target_info, self.draft_info))
        self._overlap = None  # the one thread that sends pre-drafts while the target verifies
        if config.overlap and draft is not None and config.num_speculative_tokens > 0:
            self._overlap = ThreadPoolExecutor(max_workers=1, thread_name_prefix="predraft")
        self._pending: dict[str, PreDraft] = {}  # pre-drafts awaiting this round's verdict
        self._ready: dict[str, PreDraft] = {}  # pre-drafts whose assumption the last verdict confirmed
        self.predraft_gate = PreDraftGate()  # pre-draft only requests whose pre-drafts are kept often
        # Running means that bound an unseeded request's pre-draft to what hides behind a verify.
        self._verify_mean = self._draft_step_mean = None

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
                             f"({request.params.max_new_tokens}) = {total} exceeds the context length "
                             f"{self.max_seq_len}")
        asked, most = request.num_speculative_tokens, self.config.max_request_speculative_tokens
        if asked is not None and not 0 <= asked <= most:
            raise ValueError(f"num_speculative_tokens must be between 0 and {most}, got {asked}")
        if self._known(request.req_id):
            raise ValueError(f"request id {request.req_id!r} is already in use")
        if self._blocks_for(request) > self.target_info.kv_blocks_total:
            raise ValueError(f"the request needs {self._blocks_for(request)} KV blocks but the cache has "
                             f"{self.target_info.kv_blocks_total}")

    def add_request(self, request: Request) -> None:
        self.validate(request)
        request.client_seed = request.params.seed is not None
        if request.params.seed is None:
            # The request's randomness is a function of its seed (specdec.sampling.random); the
            # coordinator holds it, so both workers, and any restarted one, use the same draws.
            request.params = dataclasses.replace(request.params, seed=random_seed())
        self.waiting.append(request)

    def _known(self, req_id: str) -> bool:
        return (req_id in self.running or any(r.req_id == req_id for r in self.waiting)
                or any(run.request.req_id == req_id for run, _ in self.adopted))

    def abort(self, req_id: str) -> bool:
        """Drop a request now (client gone); its KV blocks are freed at the start of the next round."""
        for i, r in enumerate(self.waiting):
            if r.req_id == req_id:
                del self.waiting[i]
                return True
        for i, (run, _) in enumerate(self.adopted):
            if run.request.req_id == req_id:
                del self.adopted[i]
                return True
        if req_id in self.running:
            self._retire(req_id)
            return True
        return False

    def has_work(self) -> bool:
        now = time.monotonic()
        releases_due = (self._release_target or self._release_draft) and now >= self._release_retry_at
        rounds_due = self.running and (self.target_health.due(now) or self.target_health.given_up(now))
        # A lost target is probed even when idle, so health (and the router) see it come back.
        probe_due = not self.target_health.up and self.target_health.due(now)
        return bool(self.waiting or self.adopted or rounds_due or releases_due or probe_due)

    def wake_in(self) -> float | None:
        """Seconds until a retry of a lost worker is due (None: nothing waits for one)."""
        target = self.target_health
        return None if target.up else target.wait_seconds()

    @property
    def healthy(self) -> bool:
        """False while the target is given up on (gone for good, or past its recovery timeout)."""
        return not self.target_health.given_up()

    @property
    def queue_depth(self) -> int:
        return len(self.waiting) + len(self.adopted)

    # -- moving requests between replicas ----------------------------------------------------------
    def evict(self, req_id: str) -> tuple[Request | RunningRequest, object] | None:
        """Take a request out to go on elsewhere: a waiting Request, or a running one with its
        committed tokens and its policy state (None: no such request). Its blocks here are
        released like a finished request's."""
        for i, r in enumerate(self.waiting):
            if r.req_id == req_id:
                del self.waiting[i]
                return r, None
        for i, (run, state) in enumerate(self.adopted):
            if run.request.req_id == req_id:
                del self.adopted[i]
                return run, state
        run = self.running.get(req_id)
        if run is None:
            return None
        state = self.policy.export(req_id) if self.policy is not None else None
        self._retire(req_id)
        return run, state

    def adopt(self, moved: Request | RunningRequest, policy_state: object = None) -> None:
        """Continue a request another scheduler admitted (its seed already fixed there)."""
        if isinstance(moved, Request):
            self.waiting.append(moved)
            return
        moved.started_target = False
        moved.unsent_to_draft = moved.request.prompt_ids + moved.generated  # this draft has none of it
        moved.stream.tokenizer = self.tokenizer  # tokenizers are not shared across threads
        if self.draft is None:
            moved.num_speculative_tokens = 0
        self.adopted.append((moved, policy_state))

    def _blocks_for(self, request: Request) -> int:
        # Worst case the target holds prompt + max_new_tokens tokens (K is capped to fit).
        tokens = len(request.prompt_ids) + request.params.max_new_tokens
        return blocks_for_tokens(tokens, self.target_info.kv_block_size) + 1

    def _admit(self) -> None:
        free = self.target_info.kv_blocks_total - sum(self._reserved_blocks.values())
        while self.adopted and len(self.running) < self.config.max_batch_size:  # they were admitted before
            run, state = self.adopted[0]
            need = self._blocks_for(run.request)
            if need > free:
                return
            self.adopted.popleft()
            free -= need
            self._reserved_blocks[run.request.req_id] = need
            self.running[run.request.req_id] = run
            if self.policy is not None and state is not None:
                self.policy.adopt(run.request.req_id, state)
        while self.waiting and len(self.running) < self.config.max_batch_size:
            request = self.waiting[0]
            need = self._blocks_for(request)
            if need > free:
                break  # first come, first served: wait for blocks rather than starve big requests
            self.waiting.popleft()
            free -= need
            self._reserved_blocks[request.req_id] = need
            asked = request.num_speculative_tokens
            speculative = self.config.num_speculative_tokens if asked is None else asked
            if self.draft is None:
                speculative = 0
            run = RunningRequest(request=request, num_speculative_tokens=speculative,
                                 stream=TextStream(self.tokenizer, request.params.stop))
            run.stats.prompt_tokens = len(request.prompt_ids)
            run.stats.has_draft = speculative > 0
            run.unsent_to_draft = list(request.prompt_ids)
            self.running[request.req_id] = run

    def _retire(self, req_id: str) -> None:
        run = self.running.pop(req_id)
        self._reserved_blocks.pop(req_id, None)
        if run.started_target:
            self._release_target.append(req_id)
        if run.num_speculative_tokens > 0:
            self._release_draft.append(req_id)
        if self.policy is not None:
            self.policy.forget(req_id)
        self._pending.pop(req_id, None)
        self._ready.pop(req_id, None)
        self.predraft_gate.forget(req_id)

    # -- the round --------------------------------------------------------------------------
    def _cap(self, run: RunningRequest) -> int:
        """The most a request may draft this round: shrinks near max_new_tokens and the context
        end, so a round never overflows and always commits at least one token."""
        length = len(run.request.prompt_ids) + len(run.generated)
        return max(0, min(run.num_speculative_tokens, run.remaining_tokens - 1, self.max_seq_len - length - 1))

    def _choose(self, runs: list[RunningRequest]) -> dict[str, int]:
        """K per request: the policy's choice under each cap, or the cap itself in fixed mode."""
        caps = [self._cap(run) for run in runs]
        if self.policy is None:
            return {run.request.req_id: cap for run, cap in zip(runs, caps)}
        asks = [PolicyRequest(run.request.req_id, cap, run.request.params.greedy, seeded=self._seeded(run),
                              backlog=run.draft_backlog)
                for run, cap in zip(runs, caps)]
        return dict(zip((a.req_id for a in asks), self.policy.choose(asks)))

    def step(self) -> RoundReport:
        start = time.perf_counter()
        report = RoundReport(updates=self._expire_deadlines())
        self._admit()
        greedy = {req_id: run.request.params.greedy for req_id, run in self.running.items()}
        if self.target_health.given_up() and not (self.target_health.due() and self._target_answers()):
            lost = WorkerUnavailable(self.target_health.describe())  # gone for good: fail what waits
            report.updates += self._fail_all(list(self.running.values()), lost)
            report.updates += [RequestUpdate.failure(r.req_id, str(lost), "unavailable") for r in self.waiting]
            report.updates += [RequestUpdate.failure(run.request.req_id, str(lost), "unavailable", stats=run.stats)
                               for run, _ in self.adopted]
            self.waiting.clear()
            self.adopted.clear()
        elif self.running and self.target_health.due():
            self._run_round(report)
        elif not self.running and not self.target_health.up and self.target_health.due():
            self._target_answers()  # an idle probe of a lost target (delivers pending releases)
        elif not self.running:
            self._flush_releases()
        report.total_seconds = time.perf_counter() - start
        if self.policy is not None and report.ran:
            self.policy.observe(report, greedy)
        report.queue_depth, report.running = self.queue_depth, len(self.running)
        report.workers_down = [h.role for h in (self.target_health, self.draft_health) if not h.up]
        report.kv_blocks_used, report.kv_blocks_total = self.kv_blocks_used, self.target_info.kv_blocks_total
        return report

    @staticmethod
    def _seeded(run: RunningRequest) -> bool:
        """A seeded sampled request: its tokens must not depend on how its rounds were scheduled."""
        return run.request.client_seed and not run.request.params.greedy

    def _paused(self, run: RunningRequest) -> bool:
        """Seeded sampled requests wait while the draft is lost (but not past its recovery timeout)."""
        return (not self.draft_health.up and run.num_speculative_tokens > 0 and self._seeded(run)
                and not self.draft_health.given_up())

    def _run_round(self, report: RoundReport) -> None:
        drafting = self.draft is not None and self.draft_health.due()
        runs = [run for run in self.running.values() if drafting or not self._paused(run)]
        asked = self._choose(runs) if drafting else {run.request.req_id: 0 for run in runs}
        start = time.perf_counter()
        try:
            proposals = self._draft_round(runs, asked, report) if drafting else {}
            if drafting and self.draft_health.back():
                report.resumed["draft"] = [r.request.req_id for r in runs if r.num_speculative_tokens > 0]
        except WorkerUnavailable as exc:  # rounds go on without speculation meanwhile
            self._draft_lost(exc)
            proposals, asked = {}, {req_id: 0 for req_id in asked}
            runs = [run for run in runs if not self._paused(run)]
        except Exception as exc:  # the draft broke on this round: end its requests, keep serving
            report.updates += self._fail_all(runs, exc)
            return
        report.draft_seconds = time.perf_counter() - start
        report.batch_size = len(runs)
        if not runs:
            return
        tasks = []
        for run in runs:
            proposal = proposals.get(run.request.req_id)
            tasks.append(VerifyTask(
                req_id=run.request.req_id,
                # A first round (or one after the target was lost) carries every committed token.
                new_tokens=[] if run.started_target else run.request.prompt_ids + run.generated,
                draft_tokens=proposal.tokens if proposal else [],
                q=proposal.q if proposal else None,
                params=run.request.params))
        report.target_prefill = sum(len(task.new_tokens) for task in tasks)
        predraft = self._send_predraft(runs, asked, proposals, report) if drafting else None
        finished, self._release_target = self._release_target, []
        start = time.perf_counter()
        try:
            result = self.target.verify(tasks, finished)
        except Exception as exc:
            # The releases may not have reached the worker: send them again next round
            # (workers ignore ids they do not know, e.g. after a restart).
            self._release_target = finished + self._release_target
            self._collect_predraft(predraft, report, verified=False)
            if isinstance(exc, WorkerUnavailable):  # its requests wait for it to come back
                self._target_lost(exc)
                return
            report.updates += self._fail_all(runs, exc)  # it broke on this round: end its requests
            return
        report.verify_seconds = time.perf_counter() - start
        report.worker_calls += 1
        self._verify_mean = _mean_update(self._verify_mean, report.verify_seconds)
        self._collect_predraft(predraft, report, verified=True)
        if self.target_health.back():
            report.resumed["target"] = [run.request.req_id for run in runs if run.generated]
        report.ran = True
        self.kv_blocks_used = result.kv_blocks_used
        for run in runs:
            run.started_target = True
        for outcome in result.outcomes:
            run = self.running[outcome.req_id]
            if outcome.error:  # the target refused this request's proposal: it fails alone
                self._retire(outcome.req_id)
                report.updates.append(RequestUpdate.failure(
                    outcome.req_id, f"the draft worker sent a proposal the target refused: {outcome.error}",
                    "internal", stats=run.stats))
                continue
            proposal = proposals.get(outcome.req_id)
            proposed = len(proposal.tokens) if proposal is not None else 0
            run.stats.rounds += 1
            run.stats.proposed += proposed
            run.stats.accepted += outcome.num_accepted
            if proposal is not None:
                run.stats.draft_forward_passes += proposal.draft_forward_passes
            self._verdict(outcome.req_id, outcome.tokens, report)
            update = self._commit(run, outcome.tokens)
            update.num_speculative_tokens = asked[outcome.req_id]
            update.proposed, update.accepted = proposed, outcome.num_accepted
            report.updates.append(update)

    def _target_answers(self) -> bool:
        """Is a target that was given up on back? (An empty round, delivering pending releases.)"""
        finished, self._release_target = self._release_target, []
        try:
            self.kv_blocks_used = self.target.verify([], finished).kv_blocks_used
        except Exception as exc:  # noqa: BLE001 - still gone
            self._release_target = finished + self._release_target
            self.target_health.lost(exc)
            return False
        self.target_health.back()
        return True

    def _target_lost(self, exc: WorkerUnavailable) -> None:
        """Every request the target held is gone there: release it, and re-admit it with all of
        its committed tokens on the next round that reaches the target."""
        self.target_health.lost(exc)
        self._pending.clear()
        self._ready.clear()
        for req_id, run in self.running.items():
            if run.started_target:
                run.started_target = False
                if req_id not in self._release_target:
                    self._release_target.append(req_id)

    def _draft_lost(self, exc: WorkerUnavailable) -> None:
        """The draft's copies of the sequences are gone (or stale): when it answers again, each
        request is released there and sent its whole context."""
        self.draft_health.lost(exc)
        self._pending.clear()
        self._ready.clear()
        for req_id, run in self.running.items():
            if run.num_speculative_tokens > 0:
                run.unsent_to_draft = run.request.prompt_ids + run.generated
                if req_id not in self._release_draft:
                    self._release_draft.append(req_id)

    def _draft_round(self, runs: list[RunningRequest], asked: dict[str, int],
                     report: RoundReport) -> dict[str, DraftProposal]:
        """One draft call, only when some request needs drafting this round (a confirmed pre-draft
        may already hold its proposal) or releases are due; tokens committed meanwhile reach the
        drafter with its next task."""
        if self.draft is None:
            return {}
        proposals: dict[str, DraftProposal] = {}
        heads: dict[str, DraftProposal] = {}  # confirmed pre-drafts that a serial task extends
        tasks = []
        for run in runs:
            req_id = run.request.req_id
            if run.num_speculative_tokens == 0:
                continue
            k, ready = asked[req_id], self._ready.pop(req_id, None)
            if ready is not None and ready.length != len(run.request.prompt_ids) + len(run.generated):
                ready = None  # (defensive) tokens were committed since the verdict that kept it
            assumed = []
            if ready is not None and k > 0:
                if ready.complete_for(k):
                    proposals[req_id] = ready.take(k)
                    report.predraft_kept += len(proposals[req_id].tokens)
                    continue
                heads[req_id] = ready.take(ready.asked)  # the rest is drafted after its tokens
                assumed, k = heads[req_id].tokens, k - ready.asked
                report.predraft_kept += len(assumed)
            tasks.append(DraftTask(req_id=req_id, new_tokens=run.unsent_to_draft, num_speculative_tokens=k,
                                   params=run.request.params, assumed_tokens=assumed))
        if not (any(t.num_speculative_tokens for t in tasks) or self._release_draft):
            return proposals
        finished, self._release_draft = self._release_draft, []
        report.draft_catch_up = sum(self.running[t.req_id].draft_backlog for t in tasks if t.num_speculative_tokens)
        report.draft_steps = max((t.num_speculative_tokens for t in tasks), default=0)
        report.draft_proposed = sum(t.num_speculative_tokens for t in tasks)
        start = time.perf_counter()
        try:
            replies = self.draft.propose(tasks, finished)
        except Exception:
            self._release_draft = finished + self._release_draft
            raise
        report.worker_calls += 1
        steps = max(t.num_speculative_tokens for t in tasks) if tasks else 0
        if steps:
            self._draft_step_mean = _mean_update(self._draft_step_mean, (time.perf_counter() - start) / steps)
        for task in tasks:
            self.running[task.req_id].unsent_to_draft = []
        for reply in replies:
            head = heads.get(reply.req_id)
            proposals[reply.req_id] = reply if head is None else concat_proposals(head, reply)
        return proposals

    # -- overlapped drafting --------------------------------------------------------------------
    def _predraft_length(self, run: RunningRequest, k: int, proposed: int) -> int:
        """Tokens to pre-draft after the guess g: the request's cap as of after a full acceptance
        (bounded by what the policy may ask), and for unseeded requests no more draft steps than
        hide behind a verify call. Seeded sampled requests skip the timing bound: what their
        draft computes must not depend on timing (not even on float rounding across chunkings)."""
        after = len(run.generated) + proposed + 1
        length = len(run.request.prompt_ids) + after
        remaining = run.request.params.max_new_tokens - after
        most = max(0, min(run.num_speculative_tokens, remaining - 1, self.max_seq_len - length - 1))
        if remaining <= 0 or most == 0:
            return 0
        if self._seeded(run) or not self._verify_mean or not self._draft_step_mean:
            return most
        hidden = int(self._verify_mean / self._draft_step_mean) - 1  # one step guesses g
        return max(1, min(most, hidden)) if k > 0 else 0

    def _send_predraft(self, runs: list[RunningRequest], asked: dict[str, int],
                       proposals: dict[str, DraftProposal], report: RoundReport):
        """Start the pre-draft call for every request that proposes this round; returns
        (future, tasks, releases, start time) or None."""
        if self._overlap is None:
            return None
        lengths = {}
        for run in runs:
            proposal = proposals.get(run.request.req_id)
            if proposal is None or not proposal.tokens:
                continue
            after = self._predraft_length(run, asked[run.request.req_id], len(proposal.tokens))
            if after > 0:
                lengths[run.request.req_id] = after
        chosen = self.predraft_gate.select([(run.request.req_id, run.request.params.greedy, self._seeded(run))
                                            for run in runs if run.request.req_id in lengths])
        tasks = []
        for run in runs:
            if run.request.req_id not in chosen:
                continue
            tasks.append(DraftTask(req_id=run.request.req_id, new_tokens=run.unsent_to_draft,
                                   num_speculative_tokens=lengths[run.request.req_id] + 1, params=run.request.params,
                                   assumed_tokens=list(proposals[run.request.req_id].tokens)))
            run.unsent_to_draft = []
        if not tasks:
            return None
        finished, self._release_draft = self._release_draft, []
        report.predraft_tokens = sum(t.num_speculative_tokens for t in tasks)
        start = time.perf_counter()
        future = self._overlap.submit(_timed, self.draft.propose, tasks, finished)
        return future, tasks, finished, start

    def _collect_predraft(self, predraft, report: RoundReport, verified: bool) -> None:
        """Wait for the pre-draft call; file its proposals as pending verdicts. A failed call
        costs only speculation: the draft's copies of its requests are reset."""
        if predraft is None:
            return
        future, tasks, finished, start = predraft
        waited = time.perf_counter()
        try:
            replies, seconds = future.result()
        except Exception as exc:  # noqa: BLE001 - the round's verdict stands either way
            report.predraft_wait_seconds = time.perf_counter() - waited
            self._release_draft = finished + self._release_draft
            if isinstance(exc, WorkerUnavailable):
                self._draft_lost(exc)
            else:
                self._reset_draft_copies([t.req_id for t in tasks])
            return
        report.predraft_wait_seconds = time.perf_counter() - waited
        report.predraft_seconds = seconds
        report.worker_calls += 1
        self._draft_step_mean = _mean_update(self._draft_step_mean,
                                             seconds / max(t.num_speculative_tokens for t in tasks))
        if not verified:
            return
        for task, reply in zip(tasks, replies):
            run = self.running.get(task.req_id)
            if run is None:
                continue
            pre = PreDraft.split(task.assumed_tokens, task.num_speculative_tokens, reply,
                                 len(run.request.prompt_ids) + len(run.generated))
            if pre is not None:
                self._pending[task.req_id] = pre

    def _verdict(self, req_id: str, committed: list[int], report: RoundReport) -> None:
        """Keep the request's pre-draft for the next round if the target committed what it assumed."""
        pre = self._pending.pop(req_id, None)
        if pre is None:
            return
        self.predraft_gate.observe(req_id, self.running[req_id].request.params.greedy, committed == pre.expected)
        if committed == pre.expected:
            self._ready[req_id] = pre
            report.predraft_hits += 1
            report.predraft_kept += 1  # the guess g, committed
        else:
            report.predraft_misses += 1

    def _reset_draft_copies(self, req_ids: list[str]) -> None:
        """The draft's copies of these requests may hold tokens it was not meant to record: drop
        them there, and send each request's whole context with its next task."""
        for req_id in req_ids:
            run = self.running.get(req_id)
            if run is not None:
                run.unsent_to_draft = run.request.prompt_ids + run.generated
            self._pending.pop(req_id, None)
            if req_id not in self._release_draft:
                self._release_draft.append(req_id)

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
            updates.append(RequestUpdate.failure(req.req_id, "deadline exceeded before the request started", "deadline",
                                                 stats=RequestStats(prompt_tokens=len(req.prompt_ids))))
        for run in [r for r in self.running.values() if r.request.deadline is not None and r.request.deadline <= now]:
            self._retire(run.request.req_id)
            updates.append(RequestUpdate.failure(run.request.req_id, "deadline exceeded", "deadline", stats=run.stats,
                                                 text=run.stream.finish()))
        return updates

    def _fail_all(self, runs: list[RunningRequest], exc: Exception) -> list[RequestUpdate]:
        kind = "unavailable" if isinstance(exc, WorkerUnavailable) else "internal"
        updates = []
        for run in runs:
            # The target may have admitted the request before failing: release it to be sure
            # (workers ignore ids they do not know).
            run.started_target = True
            self._retire(run.request.req_id)
            updates.append(RequestUpdate.failure(run.request.req_id, f"{type(exc).__name__}: {exc}", kind,
                                                 stats=run.stats))
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


def _timed(call, *args):
    start = time.perf_counter()
    return call(*args), time.perf_counter() - start


def _mean_update(mean: float | None, value: float, weight: float = 0.2) -> float:
    return value if mean is None else mean + weight * (value - mean)
