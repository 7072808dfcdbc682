"""Continuous batching and the speculation round loop.

Each `step()` is one round over every running request: one call to the draft worker, one to the
target worker, and a `RoundReport` of what it did. Requests join and leave between rounds. The
scheduler knows token ids, lengths and limits, never model internals. Its collaborators, one job
each: admission and KV reservation (rounds.admission), what a lost worker costs and the releases
each worker is owed (rounds.failover), overlapped drafting (rounds.predrafting), and commit with
stop conditions (rounds.commit); how many tokens each request drafts is the speculation policy's
(coordinator.speculation).

With several replicas (coordinator.replicas.router) a request can also move: `evict` takes it out
of this scheduler with its committed tokens, stream and policy state, and another replica's
scheduler `adopt`s it, re-feeding prompt + committed tokens as a fresh first round, exactly as
after a lost target: the same tokens follow.
"""
from __future__ import annotations

import time

from coordinator.rounds import commit
from coordinator.rounds.admission import Admission
from coordinator.rounds.clients import DraftClient, TargetClient
from coordinator.rounds.errors import WorkerUnavailable
from coordinator.rounds.failover import Failover, failures
from coordinator.rounds.predraft import concat_proposals
from coordinator.rounds.predrafting import PreDrafting
from coordinator.rounds.request import Request, RunningRequest
from coordinator.rounds.round_report import RequestUpdate, RoundReport
from coordinator.speculation.round_costs import RoundCosts
from coordinator.speculation.speculation_policy import PolicyRequest, SpeculationPolicy
from specdec.config import SchedulerConfig
from specdec.round_types import DraftInfo, DraftProposal, DraftTask, TargetInfo, VerifyTask
from specdec.sampling.tree import tree_size


def reference_draft_cost(target: TargetInfo, draft: DraftInfo | None) -> float:
    """A draft step's cost in target steps, from the models' sizes alone (machine-independent, so
    seeded requests can use it): 0 for the n-gram drafter."""
    parameters = (draft.extra or {}).get("parameters") if draft is not None else None
    if not parameters or not target.num_parameters:
        return 0.0
    return parameters / target.num_parameters


def seeded(run: RunningRequest) -> bool:
    """A seeded sampled request: its tokens must not depend on how its rounds were scheduled."""
    return run.request.client_seed and not run.request.params.greedy


class Scheduler:
    def __init__(self, target: TargetClient, draft: DraftClient | None, tokenizer, config: SchedulerConfig):
        self.target, self.draft, self.tokenizer, self.config = target, draft, tokenizer, config
        self.target_info = target.info()
        self.draft_info = draft.info() if draft is not None else None
        draft_vocab = self.draft_info.vocab_size if self.draft_info is not None else None
        if draft_vocab is not None and draft_vocab != self.target_info.vocab_size:
            raise ValueError(f"draft vocabulary ({draft_vocab}) differs from the target's "
                             f"({self.target_info.vocab_size}): they must share a tokenizer")
        self.max_seq_len = min([self.target_info.max_seq_len]
                               + ([self.draft_info.max_seq_len] if self.draft_info and self.draft_info.max_seq_len
                                  else []))
        self.eos_ids = set(self.target_info.eos_token_ids)
        self.running: dict[str, RunningRequest] = {}
        self.kv_blocks_used = 0
        self.admission = Admission(config, self.target_info, self.max_seq_len, tokenizer, draft is not None)
        self.failover = Failover(config)
        speculating = draft is not None and config.num_speculative_tokens > 0
        self.policy: SpeculationPolicy | None = None
        if config.adaptive and speculating:
            k = config.num_speculative_tokens
            nodes = tree_size(k, config.tree_branches, config.tree_side_depth)
            costs = RoundCosts(max_fed=config.max_batch_size * (nodes + 1), max_steps=k)  # learnt as rounds run
            self.policy = SpeculationPolicy(costs, reference_draft_cost(self.target_info, self.draft_info),
                                            config.tree_branches, config.tree_side_depth)
        self.predrafting = PreDrafting(self.max_seq_len) if config.overlap and speculating else None

    # -- requests in and out --------------------------------------------------------------------
    @property
    def waiting(self):
        return self.admission.waiting

    @property
    def target_health(self):
        return self.failover.target_health

    @property
    def draft_health(self):
        return self.failover.draft_health

    @property
    def queue_depth(self) -> int:
        return self.admission.queue_depth

    @property
    def healthy(self) -> bool:
        """False while the target is given up on (gone for good, or past its recovery timeout)."""
        return not self.target_health.given_up()

    def validate(self, request: Request) -> None:
        """Raise ValueError with a message a user can act on."""
        self.admission.validate(request)
        if request.req_id in self.running or self.admission.knows(request.req_id):
            raise ValueError(f"request id {request.req_id!r} is already in use")

    def add_request(self, request: Request) -> None:
        self.validate(request)
        self.admission.add(request)

    def abort(self, req_id: str) -> bool:
        """Drop a request now (client gone); its KV blocks are freed at the start of the next round."""
        if self.admission.take(req_id) is not None:
            return True
        if req_id in self.running:
            self._retire(req_id)
            return True
        return False

    def evict(self, req_id: str) -> tuple[Request | RunningRequest, object] | None:
        """Take a request out to go on elsewhere: a waiting Request, or a running one with its
        committed tokens and its policy state (None: no such request). Its blocks here are
        released like a finished request's."""
        taken = self.admission.take(req_id)
        if taken is not None or req_id not in self.running:
            return taken
        run, state = self.running[req_id], self.policy.export(req_id) if self.policy is not None else None
        self._retire(req_id)
        return run, state

    def adopt(self, moved: Request | RunningRequest, policy_state: object = None) -> None:
        """Continue a request another scheduler admitted (its seed already fixed there)."""
        self.admission.adopt(moved, policy_state)

    def has_work(self) -> bool:
        now = time.monotonic()
        rounds_due = self.running and (self.target_health.due(now) or self.target_health.given_up(now))
        # A lost target is probed even when idle, so health (and the router) see it come back.
        probe_due = not self.target_health.up and self.target_health.due(now)
        return bool(self.admission.queue_depth or rounds_due or self.failover.releases_due(now) or probe_due)

    def wake_in(self) -> float | None:
        """Seconds until a retry of a lost worker is due (None: nothing waits for one)."""
        return None if self.target_health.up else self.target_health.wait_seconds()

    def _retire(self, req_id: str) -> None:
        run = self.running.pop(req_id)
        self.admission.reserved.pop(req_id, None)
        self.failover.retired(req_id, run)
        if self.policy is not None:
            self.policy.forget(req_id)
        if self.predrafting is not None:
            self.predrafting.forget(req_id)

    # -- the round ----------------------------------------------------------------------------
    def step(self) -> RoundReport:
        start = time.perf_counter()
        report = RoundReport(updates=self._expire_deadlines())
        self._admit()
        greedy = {req_id: run.request.params.greedy for req_id, run in self.running.items()}
        self._serve(report)
        report.total_seconds = time.perf_counter() - start
        return self._close(report, greedy)

    def _expire_deadlines(self) -> list[RequestUpdate]:
        late = commit.past_deadline(self.running)
        for run in late:
            self._retire(run.request.req_id)
        return self.admission.expire() + [commit.deadline_update(run) for run in late]

    def _admit(self) -> None:
        for req_id, state in self.admission.admit(self.running):
            if self.policy is not None:
                self.policy.adopt(req_id, state)

    def _serve(self, report: RoundReport) -> None:
        """A round when one is due; else what an idle or lost target needs."""
        health = self.target_health
        if health.given_up() and not (health.due() and self._target_answers()):
            self._fail_everything(report, WorkerUnavailable(health.describe()))  # gone for good
        elif self.running and health.due():
            self._run_round(report)
        elif not self.running and not health.up and health.due():
            self._target_answers()  # an idle probe of a lost target (delivers pending releases)
        elif not self.running:
            used = self.failover.flush(self.target, self.draft)
            self.kv_blocks_used = self.kv_blocks_used if used is None else used

    def _close(self, report: RoundReport, greedy: dict[str, bool]) -> RoundReport:
        if self.policy is not None and report.ran:
            self.policy.observe(report, greedy)
        report.queue_depth, report.running = self.queue_depth, len(self.running)
        report.workers_down = [h.role for h in (self.target_health, self.draft_health) if not h.up]
        report.kv_blocks_used, report.kv_blocks_total = self.kv_blocks_used, self.target_info.kv_blocks_total
        return report

    def _target_answers(self) -> bool:
        used = self.failover.target_answers(self.target)
        if used is not None:
            self.kv_blocks_used = used
        return used is not None

    def _fail_everything(self, report: RoundReport, lost: WorkerUnavailable) -> None:
        report.updates += self._fail(list(self.running.values()), lost)
        report.updates += [RequestUpdate.failure(r.req_id, str(lost), "unavailable") for r in self.admission.waiting]
        report.updates += [RequestUpdate.failure(run.request.req_id, str(lost), "unavailable", stats=run.stats)
                           for run, _ in self.admission.adopted]
        self.admission.waiting.clear()
        self.admission.adopted.clear()

    def _fail(self, runs: list[RunningRequest], exc: Exception) -> list[RequestUpdate]:
        for run in runs:
            # The target may have admitted the request before failing: release it to be sure
            # (workers ignore ids they do not know).
            run.started_target = True
            self._retire(run.request.req_id)
        return failures(runs, exc)

    def _cap(self, run: RunningRequest) -> int:
        """The most a request may draft this round: shrinks near max_new_tokens and the context
        end, so a round never overflows and always commits at least one token."""
        length = len(run.request.prompt_ids) + len(run.generated)
        k = max(0, min(run.num_speculative_tokens, run.remaining_tokens - 1))
        while k and length + self._tree_size(k) + 1 > self.max_seq_len:  # (a tree's nodes all take a place)
            k -= 1
        return k

    def _tree_size(self, k: int) -> int:
        return tree_size(k, self.config.tree_branches, self.config.tree_side_depth)

    def _tree_shape(self, req_id: str) -> tuple[int, int]:
        """(branches, side depth) of a request's draft this round: the policy's choice, else as set."""
        if self.policy is not None:
            return self.policy.tree_shape(req_id)
        return self.config.tree_branches, self.config.tree_side_depth

    def _choose(self, runs: list[RunningRequest]) -> dict[str, int]:
        """K per request: the policy's choice under each cap, or the cap itself in fixed mode."""
        if self.policy is not None:
            req_ids = [run.request.req_id for run in runs]
            if self.policy.settled(req_ids):  # (a K = 0 round costs as little as plain decoding's)
                return dict.fromkeys(req_ids, 0)
        caps = [self._cap(run) for run in runs]
        if self.policy is None:
            return {run.request.req_id: cap for run, cap in zip(runs, caps)}
        asks = [PolicyRequest(run.request.req_id, cap, run.request.params.greedy, seeded=seeded(run),
                              backlog=run.draft_backlog, remaining=max(run.remaining_tokens, 1))
                for run, cap in zip(runs, caps)]
        return dict(zip((a.req_id for a in asks), self.policy.choose(asks)))

    def _run_round(self, report: RoundReport) -> None:
        drafting = self.draft is not None and self.draft_health.due()
        runs = [run for run in self.running.values() if drafting or not self.failover.paused(run, seeded(run))]
        asked = self._choose(runs) if drafting else {run.request.req_id: 0 for run in runs}
        start = time.perf_counter()
        try:
            proposals = self._draft_round(runs, asked, report) if drafting else {}
            if drafting and self.draft_health.back():
                report.resumed["draft"] = [r.request.req_id for r in runs if r.num_speculative_tokens > 0]
        except WorkerUnavailable as exc:  # rounds go on without speculation meanwhile
            self._draft_lost(exc)
            proposals, asked = {}, {req_id: 0 for req_id in asked}
            runs = [run for run in runs if not self.failover.paused(run, seeded(run))]
        except Exception as exc:  # the draft broke on this round: end its requests, keep serving
            report.updates += self._fail(runs, exc)
            return
        report.draft_seconds = time.perf_counter() - start
        report.batch_size = len(runs)
        if runs:
            self._verify_round(runs, asked, proposals, drafting, report)

    def _verify_round(self, runs: list[RunningRequest], asked: dict[str, int], proposals: dict[str, DraftProposal],
                      drafting: bool, report: RoundReport) -> None:
        tasks = [VerifyTask(req_id=run.request.req_id,
                            # A first round (or one after the target was lost) carries every committed token.
                            new_tokens=[] if run.started_target else run.request.prompt_ids + run.generated,
                            draft_tokens=proposals[run.request.req_id].tokens if run.request.req_id in proposals
                            else [], q=proposals[run.request.req_id].q if run.request.req_id in proposals else None,
                            params=run.request.params,
                            parents=proposals[run.request.req_id].parents if run.request.req_id in proposals else [])
                 for run in runs]
        report.target_prefill = sum(len(task.new_tokens) for task in tasks)
        predraft = None
        if drafting and self.predrafting is not None:
            predraft = self.predrafting.send(self.draft, runs, asked, proposals,
                                             {run.request.req_id: seeded(run) for run in runs}, self.failover, report)
        releases, self.failover.release_target = self.failover.release_target, []
        start = time.perf_counter()
        try:
            result = self.target.verify(tasks, releases)
        except Exception as exc:
            # The releases may not have reached the worker: send them again next round
            # (workers ignore ids they do not know, e.g. after a restart).
            self.failover.release_target = releases + self.failover.release_target
            self._collect_predraft(predraft, verified=False, report=report)
            if isinstance(exc, WorkerUnavailable):  # its requests wait for it to come back
                self.failover.target_lost(exc, self.running)
                if self.predrafting is not None:
                    self.predrafting.clear()
                return
            report.updates += self._fail(runs, exc)  # it broke on this round: end its requests
            return
        report.verify_seconds = time.perf_counter() - start
        report.worker_calls += 1
        if self.predrafting is not None:
            self.predrafting.timed_verify_call(report.verify_seconds)
        self._collect_predraft(predraft, verified=True, report=report)
        if self.target_health.back():
            report.resumed["target"] = [run.request.req_id for run in runs if run.generated]
        report.ran = True
        self.kv_blocks_used = result.kv_blocks_used
        for run in runs:
            run.started_target = True
        for outcome in result.outcomes:
            self._apply_verdict(outcome, proposals.get(outcome.req_id), asked[outcome.req_id], report)

    def _apply_verdict(self, outcome, proposal: DraftProposal | None, asked: int, report: RoundReport) -> None:
        run = self.running[outcome.req_id]
        if outcome.error:  # the target refused this request's proposal: it fails alone
            self._retire(outcome.req_id)
            report.updates.append(RequestUpdate.failure(
                outcome.req_id, f"the draft worker sent a proposal the target refused: {outcome.error}",
                "internal", stats=run.stats))
            return
        # A tree's proposal counts as deep as its longest branch: acceptance is per depth.
        proposed = proposal.depth if proposal is not None else 0
        run.stats.rounds += 1
        run.stats.proposed += proposed
        run.stats.accepted += outcome.num_accepted
        if proposal is not None:
            run.stats.draft_forward_passes += proposal.draft_forward_passes
        if self.predrafting is not None:
            self.predrafting.verdict(outcome.req_id, run.request.params.greedy, outcome.tokens, report)
        update = commit.commit(run, outcome.tokens, self.eos_ids)
        if update.finished:
            self._retire(outcome.req_id)
        update.num_speculative_tokens, update.proposed, update.accepted = asked, proposed, outcome.num_accepted
        if proposal is not None and proposal.parents:
            update.tree_nodes = len(proposal.tokens)
            first_kept = outcome.num_accepted > 0 and outcome.tokens[0] == proposal.tokens[0]
            update.side_tried = proposal.parents.count(-1) > 1 and not first_kept
            update.side_kept = update.side_tried and outcome.num_accepted > 0
        report.updates.append(update)

    def _collect_predraft(self, predraft, verified: bool, report: RoundReport) -> None:
        if self.predrafting is not None:
            self.predrafting.collect(predraft, verified, self.running, self.failover, report)

    def _draft_lost(self, exc: WorkerUnavailable) -> None:
        self.failover.draft_lost(exc, self.running)
        if self.predrafting is not None:
            self.predrafting.clear()

    def _draft_round(self, runs: list[RunningRequest], asked: dict[str, int],
                     report: RoundReport) -> dict[str, DraftProposal]:
        """One draft call, only when some request needs drafting this round (a confirmed pre-draft
        may already hold its proposal) or releases are due; tokens committed meanwhile reach the
        drafter with its next task."""
        proposals: dict[str, DraftProposal] = {}
        taking = self.predrafting is not None and self.predrafting.ready
        if not (any(asked.values()) or self.failover.release_draft or taking):
            return proposals  # (nothing to draft, release or take: a K = 0 round skips the tasks)
        heads: dict[str, DraftProposal] = {}  # confirmed pre-drafts that a serial task extends
        tasks = []
        for run in runs:
            req_id = run.request.req_id
            if run.num_speculative_tokens == 0:
                continue
            k = asked[req_id]
            ready = self.predrafting.ready.pop(req_id, None) if self.predrafting is not None else None
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
            if k == 0:  # (its tokens wait in unsent_to_draft: the backlog its first draft call pays, priced)
                continue
            branches, side_depth = (1, 0) if assumed else self._tree_shape(req_id)
            tasks.append(DraftTask(req_id=req_id, new_tokens=run.unsent_to_draft, num_speculative_tokens=k,
                                   params=run.request.params, assumed_tokens=assumed,
                                   branches=branches, side_depth=side_depth))
        if not (any(t.num_speculative_tokens for t in tasks) or self.failover.release_draft):
            return proposals
        releases, self.failover.release_draft = self.failover.release_draft, []
        report.draft_catch_up = sum(self.running[t.req_id].draft_backlog for t in tasks if t.num_speculative_tokens)
        report.draft_steps = max((t.num_speculative_tokens for t in tasks), default=0)
        report.draft_proposed = sum(tree_size(t.num_speculative_tokens, t.branches, t.side_depth) for t in tasks)
        start = time.perf_counter()
        try:
            replies = self.draft.propose(tasks, releases)
        except Exception:
            self.failover.release_draft = releases + self.failover.release_draft
            raise
        report.worker_calls += 1
        if self.predrafting is not None:
            self.predrafting.timed_draft_call(time.perf_counter() - start, report.draft_steps)
        for task in tasks:
            self.running[task.req_id].unsent_to_draft = []
        for reply in replies:
            head = heads.get(reply.req_id)
            proposals[reply.req_id] = reply if head is None else concat_proposals(head, reply)
        return proposals
