"""Overlapped drafting (config.overlap): the draft drafts round r+1 while the target verifies round r.

Beside each verify call the draft gets a pre-draft task on a one-thread executor: for each chosen
request, its proposal as if the target accepted all of it, a guess g of the target's bonus token,
and the tokens after g. Its result is collected before the round ends, so nothing is in flight
between rounds (a request may be aborted or a worker lost between them) and the work a round does
depends on the tokens, never on timing. A pre-draft is used only when the verdict committed
exactly what it assumed (proposal + g); which requests get one is the gate's choice
(coordinator.speculation.predraft_gate).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from coordinator.rounds.clients import DraftClient
from coordinator.rounds.errors import WorkerUnavailable
from coordinator.rounds.failover import Failover
from coordinator.rounds.predraft import PreDraft
from coordinator.rounds.request import RunningRequest
from coordinator.rounds.round_report import RoundReport
from coordinator.speculation.predraft_gate import PreDraftGate
from specdec.round_types import DraftProposal, DraftTask

_MEAN_WEIGHT = 0.2  # of each new call in the running means below


@dataclass
class PreDraftCall:
    """A pre-draft call in flight: its future (replies, seconds), tasks and the releases it carries."""

    future: Future
    tasks: list[DraftTask]
    releases: list[str]


class PreDrafting:
    def __init__(self, max_seq_len: int):
        self.max_seq_len = max_seq_len
        self.gate = PreDraftGate()  # pre-draft only requests whose pre-drafts are kept often
        self.pending: dict[str, PreDraft] = {}  # pre-drafts awaiting this round's verdict
        self.ready: dict[str, PreDraft] = {}  # pre-drafts whose assumption the last verdict confirmed
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="predraft")
        # Running means that bound an unseeded request's pre-draft to what hides behind a verify.
        self._verify_mean: float | None = None
        self._draft_step_mean: float | None = None

    def forget(self, req_id: str) -> None:
        self.pending.pop(req_id, None)
        self.ready.pop(req_id, None)
        self.gate.forget(req_id)

    def clear(self) -> None:
        """A worker was lost: no pre-draft holds any more."""
        self.pending.clear()
        self.ready.clear()

    def timed_draft_call(self, seconds: float, steps: int) -> None:
        if steps:
            self._draft_step_mean = _mean_update(self._draft_step_mean, seconds / steps)

    def timed_verify_call(self, seconds: float) -> None:
        self._verify_mean = _mean_update(self._verify_mean, seconds)

    def _length(self, run: RunningRequest, k: int, proposed: int, seeded: bool) -> int:
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
        if seeded or not self._verify_mean or not self._draft_step_mean:
            return most
        hidden = int(self._verify_mean / self._draft_step_mean) - 1  # one step guesses g
        return max(1, min(most, hidden)) if k > 0 else 0

    def send(self, draft: DraftClient, runs: list[RunningRequest], asked: dict[str, int],
             proposals: dict[str, DraftProposal], seeded: dict[str, bool], failover: Failover,
             report: RoundReport) -> PreDraftCall | None:
        """Start the pre-draft call for every chosen request that proposes this round (`seeded`:
        req_id -> a seeded sampled request); the draft's pending releases go with it."""
        lengths = {}
        for run in runs:
            proposal = proposals.get(run.request.req_id)
            if proposal is not None and proposal.tokens:
                after = self._length(run, asked[run.request.req_id], len(proposal.tokens), seeded[run.request.req_id])
                if after > 0:
                    lengths[run.request.req_id] = after
        chosen = self.gate.select([(run.request.req_id, run.request.params.greedy, seeded[run.request.req_id])
                                   for run in runs if run.request.req_id in lengths])
        tasks = []
        for run in runs:
            if run.request.req_id in chosen:
                tasks.append(DraftTask(req_id=run.request.req_id, new_tokens=run.unsent_to_draft,
                                       num_speculative_tokens=lengths[run.request.req_id] + 1,
                                       params=run.request.params,
                                       assumed_tokens=list(proposals[run.request.req_id].tokens)))
                run.unsent_to_draft = []
        if not tasks:
            return None
        releases, failover.release_draft = failover.release_draft, []
        report.predraft_tokens = sum(t.num_speculative_tokens for t in tasks)
        return PreDraftCall(self._executor.submit(_timed, draft.propose, tasks, releases), tasks, releases)

    def collect(self, call: PreDraftCall | None, verified: bool, running: dict[str, RunningRequest],
                failover: Failover, report: RoundReport) -> None:
        """Wait for the pre-draft call; file its proposals as pending verdicts (`verified`: the
        round's verify call succeeded). A failed call costs only speculation: the draft's copies
        of its requests are reset."""
        if call is None:
            return
        waited = time.perf_counter()
        try:
            replies, seconds = call.future.result()
        except Exception as exc:  # noqa: BLE001 - the round's verdict stands either way
            report.predraft_wait_seconds = time.perf_counter() - waited
            failover.release_draft = call.releases + failover.release_draft
            if isinstance(exc, WorkerUnavailable):
                failover.draft_lost(exc, running)
                self.clear()
            else:
                failover.reset_draft_copies([t.req_id for t in call.tasks], running)
                for task in call.tasks:
                    self.pending.pop(task.req_id, None)
            return
        report.predraft_wait_seconds = time.perf_counter() - waited
        report.predraft_seconds = seconds
        report.worker_calls += 1
        self.timed_draft_call(seconds, max(t.num_speculative_tokens for t in call.tasks))
        if not verified:
            return
        for task, reply in zip(call.tasks, replies):
            run = running.get(task.req_id)
            if run is None:
                continue
            pre = PreDraft.split(task.assumed_tokens, task.num_speculative_tokens, reply,
                                 len(run.request.prompt_ids) + len(run.generated))
            if pre is not None:
                self.pending[task.req_id] = pre

    def verdict(self, req_id: str, greedy: bool, committed: list[int], report: RoundReport) -> None:
        """Keep the request's pre-draft for the next round if the target committed what it assumed."""
        pre = self.pending.pop(req_id, None)
        if pre is None:
            return
        self.gate.observe(req_id, greedy, committed == pre.expected)
        if committed == pre.expected:
            self.ready[req_id] = pre
            report.predraft_hits += 1
            report.predraft_kept += 1  # the guess g, committed
        else:
            report.predraft_misses += 1


def _timed(call, *args):
    start = time.perf_counter()
    return call(*args), time.perf_counter() - start


def _mean_update(mean: float | None, value: float) -> float:
    return value if mean is None else mean + _MEAN_WEIGHT * (value - mean)
