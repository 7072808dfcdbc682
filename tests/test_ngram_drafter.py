"""Prompt-lookup (n-gram) drafting: the lookup rule, proposals and their q, state release."""
from __future__ import annotations

import random

import pytest
import torch

from draft_worker.ngram_drafter import NgramDrafter, lookup_continuation, lookup_continuations
from draft_worker.worker import DraftWorker, build_drafter
from specdec.config import NGRAM, ConfigError, DraftConfig
from specdec.params import SamplingParams
from specdec.round_types import DraftTask

GREEDY = SamplingParams(max_new_tokens=8)


def ngram(**settings) -> NgramDrafter:
    """An n-gram drafter with the config's defaults, except `settings` (ngram_max, ...)."""
    return build_drafter(DraftConfig(model=NGRAM, **settings))
SAMPLED = SamplingParams(max_new_tokens=8, temperature=0.8, seed=1)


# ---------------------------------------------------------------- lookup_continuation

def test_no_match_gives_empty():
    assert lookup_continuation([1, 2, 3, 4], max_tokens=3, max_ngram=3, min_ngram=1) == []


def test_empty_and_single_token_contexts():
    assert lookup_continuation([], max_tokens=3, max_ngram=3, min_ngram=1) == []
    assert lookup_continuation([7], max_tokens=3, max_ngram=3, min_ngram=1) == []


def test_unigram_match_returns_following_tokens():
    # suffix [5] occurred at index 0, followed by 6, 7
    assert lookup_continuation([5, 6, 7, 5], max_tokens=2, max_ngram=3, min_ngram=1) == [6, 7]


def test_k_limits_length_and_continuation_may_be_shorter_than_k():
    tokens = [1, 2, 3, 4, 5, 6, 1]
    assert lookup_continuation(tokens, max_tokens=3, max_ngram=2, min_ngram=1) == [2, 3, 4]
    assert lookup_continuation(tokens, max_tokens=1, max_ngram=2, min_ngram=1) == [2]
    # continuation runs into the end of the context: fewer than k tokens
    assert lookup_continuation([9, 8, 9], max_tokens=5, max_ngram=2, min_ngram=1) == [8, 9]


def test_longest_ngram_wins_over_more_recent_shorter_match():
    # The bigram [1, 2] occurs at index 0 (followed by 10); the unigram [2] also occurs more
    # recently at index 4 (followed by 20). The longer n-gram must win.
    tokens = [1, 2, 10, 3, 2, 20, 1, 2]
    assert lookup_continuation(tokens, max_tokens=1, max_ngram=3, min_ngram=1) == [10]
    # With max_ngram=1 only the unigram can match: then the most recent occurrence wins.
    assert lookup_continuation(tokens, max_tokens=1, max_ngram=1, min_ngram=1) == [20]


def test_most_recent_occurrence_wins():
    tokens = [4, 5, 1, 4, 5, 2, 4, 5, 3, 4, 5]
    assert lookup_continuation(tokens, max_tokens=1, max_ngram=2, min_ngram=2) == [3]
    assert lookup_continuation(tokens, max_tokens=4, max_ngram=2, min_ngram=2) == [3, 4, 5]


def test_min_ngram_excludes_short_matches():
    tokens = [1, 2, 3, 9, 3]
    assert lookup_continuation(tokens, max_tokens=2, max_ngram=3, min_ngram=1) == [9, 3]
    assert lookup_continuation(tokens, max_tokens=2, max_ngram=3, min_ngram=2) == []


def test_repeated_token_run_overlapping_match():
    # [7, 7, 7, 7]: the suffix [7, 7, 7] matches at start 0 and is followed by 7.
    assert lookup_continuation([7, 7, 7, 7], max_tokens=3, max_ngram=3, min_ngram=1) == [7]
    assert lookup_continuation([7, 7, 7, 7], max_tokens=3, max_ngram=1, min_ngram=1) == [7]


def _reference_lookup(tokens, k, max_ngram, min_ngram):
    """Brute force restatement of the rule: longest n, then latest earlier start."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > len(tokens) - 1:
            continue
        suffix = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == suffix]
        if starts:
            s = max(starts)
            return tokens[s + n:s + n + k]
    return []


def test_lookup_matches_brute_force_on_random_contexts():
    rng = random.Random(0)
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 20))]
        k = rng.randrange(1, 6)
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        got = lookup_continuation(tokens, k, hi, lo)
        assert got == _reference_lookup(tokens, k, hi, lo), (tokens, k, hi, lo)
        assert len(got) <= k


# ---------------------------------------------------------------- the drafter

def test_several_matches_give_branches_with_distinct_first_tokens():
    """The longest match's continuation first, then shorter matches' from the most recent back,
    skipping a first token already taken."""
    tokens = [1, 4, 2, 1, 3, 5, 1, 5, 2, 1]  # "2 1" was followed by 3; "1" by 5, by 3, by 4
    assert lookup_continuations(tokens, 2, 4, 1, 3) == [[3, 5], [5, 2], [4, 2]]
    assert lookup_continuations(tokens, 2, 4, 1, 9) == [[3, 5], [5, 2], [4, 2]]  # no more to find
    assert lookup_continuations(tokens, 2, 4, 1, 1) == [lookup_continuation(tokens, 2, 4, 1)]


def test_a_tree_task_gets_the_branches_depth_first_with_one_hot_q():
    tokens = [1, 4, 2, 1, 3, 5, 1, 5, 2, 1]
    proposal = ngram().propose([DraftTask("r", tokens, 2, SAMPLED, branches=3)])[0]
    assert proposal.tokens == [3, 5, 5, 2, 4, 2] and proposal.parents == [-1, 0, -1, 2, -1, 4]
    assert proposal.q.token_ids[:, 0].tolist() == proposal.tokens and proposal.q.probs.eq(1).all()
    single = ngram().propose([DraftTask("r", [5, 6, 7, 5], 2, SAMPLED, branches=3)])[0]
    assert single.tokens == [6, 7] and single.parents == []  # one match: a chain


def test_constructor_validates_ngram_bounds():
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=2, min_ngram=3, window=16)
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=2, min_ngram=0, window=16)
    with pytest.raises(ConfigError, match="draft.ngram_max"):
        ngram(ngram_max=2, ngram_min=3)


def test_greedy_proposal_has_no_q():
    d = ngram(ngram_max=3)
    [p] = d.propose([DraftTask("a", [1, 2, 3, 1, 2], num_speculative_tokens=4, params=GREEDY)])
    assert p.req_id == "a"
    assert p.tokens == [3, 1, 2]
    assert p.q is None
    assert p.draft_forward_passes == 0


def test_sampled_proposal_carries_one_hot_q():
    d = ngram(ngram_max=3)
    [p] = d.propose([DraftTask("s", [1, 2, 3, 1, 2], num_speculative_tokens=2, params=SAMPLED)])
    assert p.tokens == [3, 1]
    assert p.q is not None and p.q.num_positions == 2
    dense = p.q.to_dense(10)
    expected = torch.zeros(2, 10)
    expected[0, 3] = 1.0
    expected[1, 1] = 1.0
    assert torch.equal(dense, expected)


def test_no_match_for_sampled_request_has_no_q():
    d = ngram()
    [p] = d.propose([DraftTask("s", [1, 2, 3], num_speculative_tokens=3, params=SAMPLED)])
    assert p.tokens == [] and p.q is None


def test_k_zero_records_tokens_but_proposes_nothing():
    d = ngram(ngram_max=2)
    [p] = d.propose([DraftTask("a", [1, 2, 3], num_speculative_tokens=0, params=GREEDY)])
    assert p.tokens == [] and p.q is None
    # The tokens were recorded: the next round's lookup sees them.
    [p] = d.propose([DraftTask("a", [1], num_speculative_tokens=2, params=GREEDY)])
    assert p.tokens == [2, 3]


def test_state_accumulates_across_rounds_and_batch_rows_are_independent():
    d = ngram(ngram_max=2)
    out = d.propose([DraftTask("a", [5, 6, 7], num_speculative_tokens=2, params=GREEDY),
                     DraftTask("b", [9, 9], num_speculative_tokens=2, params=GREEDY)])
    assert [p.req_id for p in out] == ["a", "b"]
    assert out[0].tokens == [] and out[1].tokens == [9]
    out = d.propose([DraftTask("a", [5], num_speculative_tokens=2, params=GREEDY),
                     DraftTask("b", [1], num_speculative_tokens=2, params=GREEDY)])
    assert out[0].tokens == [6, 7]
    assert out[1].tokens == []


def test_window_bounds_the_lookup():
    d = ngram(ngram_max=1, ngram_window=3)
    # 1 occurs at the start (outside the window) and at the end only
    [p] = d.propose([DraftTask("a", [1, 2, 3, 4, 5, 1], num_speculative_tokens=2, params=GREEDY)])
    assert p.tokens == []


def test_release_forgets_state_and_ignores_unknown_ids():
    d = ngram()
    d.propose([DraftTask("a", [1, 2, 1], num_speculative_tokens=2, params=GREEDY),
               DraftTask("b", [3, 3], num_speculative_tokens=1, params=GREEDY)])
    assert set(d._tokens) == {"a", "b"}
    d.release(["a", "never-seen"])
    assert set(d._tokens) == {"b"}
    # A released id starts from scratch if reused.
    [p] = d.propose([DraftTask("a", [1], num_speculative_tokens=2, params=GREEDY)])
    assert p.tokens == []


def test_draft_worker_releases_finished_before_proposing():
    w = DraftWorker(ngram())
    assert w.info().kind == "ngram"
    w.propose([DraftTask("a", [1, 2, 1], num_speculative_tokens=2, params=GREEDY)], finished=[])
    assert "a" in w.drafter._tokens
    assert w.propose([], finished=["a"]) == []
    assert w.drafter._tokens == {}
