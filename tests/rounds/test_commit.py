"""Commit (coordinator.rounds.commit): stop conditions apply to the committed tokens in order;
nothing past a request's end is kept or streamed."""
from __future__ import annotations

from coordinator.rounds.commit import commit
from coordinator.rounds.request import Request, RunningRequest
from coordinator.rounds.text_stream import TextStream
from specdec.params import SamplingParams


def running(max_new_tokens: int = 10, ignore_eos: bool = False) -> RunningRequest:
    request = Request("r", [1, 2], SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos))
    return RunningRequest(request=request, num_speculative_tokens=4, stream=TextStream(None, ()))


def test_a_verdict_is_kept_up_to_max_new_tokens_and_no_further():
    run = running(max_new_tokens=3)
    first = commit(run, [5, 6], eos_ids={9})
    assert first.token_ids == [5, 6] and not first.finished
    last = commit(run, [7, 8, 4], eos_ids={9})
    assert last.token_ids == [7] and last.finished and last.finish_reason == "length"
    assert run.generated == [5, 6, 7] and run.unsent_to_draft[-3:] == [5, 6, 7] and run.stats.generated == 3


def test_eos_ends_a_request_unless_it_ignores_eos():
    update = commit(running(), [5, 9, 6], eos_ids={9})
    assert update.token_ids == [5, 9] and update.finish_reason == "eos"
    update = commit(running(ignore_eos=True), [5, 9, 6], eos_ids={9})
    assert update.token_ids == [5, 9, 6] and not update.finished
