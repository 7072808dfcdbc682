"""Overlapped drafting's bookkeeping (coordinator.rounds.predrafting): a pre-draft is kept only
when the verdict committed what it assumed; its length stays within the request's cap and, for
unseeded requests, within what hides behind a verify call; a failed pre-draft call resets the
draft's copies of its requests."""
from __future__ import annotations

from concurrent.futures import Future

from coordinator.rounds.failover import Failover
from coordinator.rounds.predraft import PreDraft
from coordinator.rounds.predrafting import PreDraftCall, PreDrafting
from coordinator.rounds.request import Request, RunningRequest
from coordinator.rounds.round_report import RoundReport
from coordinator.rounds.text_stream import TextStream
from specdec.config import SchedulerConfig
from specdec.params import SamplingParams
from specdec.round_types import DraftProposal, DraftTask


def running(req_id: str = "r", max_new_tokens: int = 50) -> RunningRequest:
    request = Request(req_id, [1, 2, 3], SamplingParams(max_new_tokens=max_new_tokens))
    return RunningRequest(request=request, num_speculative_tokens=5, stream=TextStream(None, ()), generated=[4])


def test_a_pre_draft_is_kept_only_when_the_target_committed_what_it_assumed():
    predrafting, report = PreDrafting(max_seq_len=100), RoundReport()
    for req_id in ("hit", "miss"):
        predrafting.pending[req_id] = PreDraft(expected=[7, 8], after=DraftProposal(req_id, [9, 9], None),
                                               asked=2, length=6)
    predrafting.verdict("hit", True, [7, 8], report)
    predrafting.verdict("miss", True, [7, 5], report)
    assert set(predrafting.ready) == {"hit"} and not predrafting.pending
    assert (report.predraft_hits, report.predraft_misses) == (1, 1)


def test_a_pre_draft_stays_within_the_cap_and_what_a_verify_call_hides():
    predrafting, run = PreDrafting(max_seq_len=100), running(max_new_tokens=4)
    assert predrafting._length(run, k=5, proposed=1, seeded=False) == 0  # after 1 + 1 + g, no room left
    run = running()
    assert predrafting._length(run, k=5, proposed=2, seeded=False) == 5  # nothing timed yet: the cap
    predrafting.timed_verify_call(0.004)
    predrafting.timed_draft_call(0.002, steps=2)  # 1 ms a step: 4 ms hide 3 steps after g
    assert predrafting._length(run, k=5, proposed=2, seeded=False) == 3
    assert predrafting._length(run, k=5, proposed=2, seeded=True) == 5  # never a timing for seeded ones


def test_a_failed_pre_draft_call_resets_the_drafts_copies_of_its_requests():
    predrafting, failover, run = PreDrafting(max_seq_len=100), Failover(SchedulerConfig()), running()
    future = Future()
    future.set_exception(RuntimeError("draft worker broke"))
    call = PreDraftCall(future, [DraftTask("r", [], 3, run.request.params)], releases=["old"])
    predrafting.collect(call, verified=True, running={"r": run}, failover=failover, report=RoundReport())
    assert run.unsent_to_draft == [1, 2, 3, 4] and failover.release_draft == ["old", "r"]
