"""The speculation policy on its own: K per request from acceptance and round costs, probing,
and the seeded requests' rule that depends on their own history only."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.round_costs import RoundCosts
from coordinator.round_report import RequestUpdate, RoundReport
from coordinator.speculation_policy import (
    PROBE_AFTER,
    PROBE_SHARE,
    REDECIDE_ROUNDS,
    PolicyRequest,
    SpeculationPolicy,
    expected_tokens,
)


def costs(draft_step=0.05, verify_slope=0.05, batch_slope=0.0) -> RoundCosts:
    """A target step costs 1 at batch 1 (+ batch_slope per extra sequence); each extra verified
    token per sequence costs verify_slope (x batch); a draft step draft_step."""
    batches, tokens = [1, 8, 32], [1, 2, 6, 9]
    grid = [[1.0 + batch_slope * (b - 1) + verify_slope * b * (t - 1) for t in tokens] for b in batches]
    return RoundCosts(batch_sizes=batches, verify_tokens=tokens, verify_grid=grid,
                      draft_step=[draft_step] * len(batches))


def outcome(req_id: str, proposed: int, accepted: int, asked: int | None = None) -> RequestUpdate:
    return RequestUpdate(req_id=req_id, token_ids=[1] * (accepted + 1), text="", proposed=proposed,
                         accepted=accepted, num_speculative_tokens=proposed if asked is None else asked)


def observe(policy: SpeculationPolicy, updates: list[RequestUpdate], greedy: bool = True) -> None:
    policy.observe(RoundReport(updates=updates, ran=True), {u.req_id: greedy for u in updates})


def greedy(req_id: str, cap: int = 5) -> PolicyRequest:
    return PolicyRequest(req_id, cap, greedy=True, seeded=False)


def test_expected_tokens_formula():
    a = np.array([0.0, 0.5, 0.9])
    assert expected_tokens(a, np.array([3, 3, 3])).tolist() == pytest.approx([1.0, 1.875, 3.439])


def test_well_accepted_drafts_on_cheap_steps_take_the_cap():
    policy = SpeculationPolicy(costs(), reference_draft_cost=0.1)
    for _ in range(5):
        observe(policy, [outcome("a", 5, 5)])
    assert policy.choose([greedy("a")]) == [5]
    assert policy.choose([greedy("a", cap=2)]) == [2]  # never above the cap


def round_of(policy: SpeculationPolicy, request: PolicyRequest, accept_all: bool) -> int:
    """choose, then observe what that round did (all or none of its drafts accepted)."""
    k = policy.choose([request])[0]
    observe(policy, [outcome(request.req_id, k, k if accept_all else 0)])
    return k


def test_drafts_that_keep_failing_fall_back_to_plain_decoding_then_probe_and_return():
    policy = SpeculationPolicy(costs(draft_step=0.3), reference_draft_cost=0.1)
    for _ in range(6):
        observe(policy, [outcome("a", 3, 0)])
    ks = [round_of(policy, greedy("a"), accept_all=False)]
    while ks[-1] == 0 and len(ks) < 10 / PROBE_SHARE:
        ks.append(round_of(policy, greedy("a"), accept_all=False))
    assert len(ks) >= PROBE_AFTER and ks[:-1] == [0] * (len(ks) - 1)  # plain decoding...
    assert ks[-1] == 5  # ...until a probe (its clock is due, its credit suffices): the full cap
    for _ in range(4):  # the probes find the drafts good now: speculation comes back
        observe(policy, [outcome("a", 5, 5)])
    assert all(round_of(policy, greedy("a"), accept_all=True) > 0 for _ in range(2 * PROBE_AFTER))


def test_a_round_that_never_ran_leaves_no_trace():
    """choose() without observe() (the round failed, a worker died) must not move the probe
    schedule: the retried round chooses exactly as the first attempt did."""
    policy = SpeculationPolicy(costs(draft_step=0.3), reference_draft_cost=0.1)
    for _ in range(6):
        observe(policy, [outcome("a", 3, 0)])
    first = [policy.choose([greedy("a")])[0] for _ in range(3 * PROBE_AFTER)]
    assert first == [0] * len(first)


def test_a_run_of_rejections_fades_while_the_request_decodes_plainly():
    """Evidence decays at rounds without drafting too: after a run of rejections has taken a request
    to K = 0, its estimate drifts back to the drafter's recent rate round by round, so it drafts
    again on its merits instead of waiting for a probe with an estimate nothing can change."""
    policy = SpeculationPolicy(costs(draft_step=0.3), reference_draft_cost=0.1, initial_prior=0.8)
    request = greedy("a")
    assert policy.choose([request])[0] > 0
    for _ in range(10):  # rejections until it stops drafting
        observe(policy, [outcome("a", 1, 0)])
        if policy.choose([request]) == [0]:
            break
    low = policy.alpha(request)
    assert policy.choose([request]) == [0]
    alphas = []
    for _ in range(12):
        k = policy.choose([request])[0]
        if k:
            break
        observe(policy, [outcome("a", 0, 0)])
        alphas.append(policy.alpha(request))
    assert alphas == sorted(alphas) and alphas[0] > low  # rising towards the prior of 0.8
    assert k > 0 and policy._chosen["a"] == "merit"  # back on its merits, before any probe was due


def test_failed_probes_wait_longer_each_time():
    policy = SpeculationPolicy(costs(draft_step=0.3), reference_draft_cost=0.1)
    probes = []
    for round_index in range(3 * PROBE_AFTER + 2 * PROBE_AFTER):
        if round_of(policy, greedy("a"), accept_all=False):
            probes.append(round_index)
    assert len(probes) >= 2 and probes[1] - probes[0] > probes[0]  # the wait doubled


def test_requests_at_zero_probe_together_so_a_batch_pays_for_one_probe_call():
    """Requests that fell back at different rounds would each probe on their own clock, a draft
    call every few rounds for the batch; an unseeded request at 0 probes whenever any batch mate
    is due, so probe rounds are shared (seeded requests keep their own clocks)."""
    policy = SpeculationPolicy(costs(draft_step=0.3), reference_draft_cost=0.1)
    batch = [greedy(f"r{i}") for i in range(6)] + [PolicyRequest("seeded", 5, greedy=False, seeded=True)]
    for request in batch[:6]:
        for _ in range(6):
            observe(policy, [outcome(request.req_id, 3, 0)])
    for joined in range(1, 7):  # staggered clocks: the requests joined one round apart
        ks = policy.choose(batch[:joined])
        observe(policy, [outcome(r.req_id, k, 0) for r, k in zip(batch, ks)])
    probe_rounds = []
    for round_index in range(400):
        ks = policy.choose(batch)
        unseeded = ks[:6]
        assert len(set(unseeded)) == 1  # all at 0, or all probing their cap together
        if unseeded[0]:
            probe_rounds.append(round_index)
        observe(policy, [outcome(r.req_id, k, 0) for r, k in zip(batch, ks)])
    assert probe_rounds
    # They spend about PROBE_SHARE of the time: each probe round's net cost out of the credit.
    alphas = np.array([policy.alpha(r) for r in batch])
    plain, probing = np.zeros(len(batch), dtype=np.int64), np.array([5] * 6 + [0])
    seconds = policy._round_seconds(np.stack([plain, probing]), sampled=True)
    net = seconds[1] - expected_tokens(alphas, probing).sum() * seconds[0] / len(batch)
    assert len(probe_rounds) * net <= PROBE_SHARE * 400 * seconds[0] + net


def test_requests_in_one_batch_get_their_own_k():
    policy = SpeculationPolicy(costs(draft_step=0.02, verify_slope=0.08), reference_draft_cost=0.1)
    for _ in range(6):
        observe(policy, [outcome("good", 5, 5), outcome("poor", 5, 0), outcome("mid", 5, 2)])
    ks = dict(zip(["good", "poor", "mid"], policy.choose([greedy("good"), greedy("poor"), greedy("mid")])))
    assert ks["good"] > ks["mid"] > ks["poor"] == 0


def test_k_falls_as_verified_tokens_get_dearer_with_the_batch():
    """At batch 1 an extra verified token is nearly free; at batch 32 it costs as much as the
    others' tokens: the same acceptance deserves a shorter draft."""
    policy = SpeculationPolicy(costs(draft_step=0.02, verify_slope=0.02, batch_slope=0.1), reference_draft_cost=0.1)
    names = [f"r{i}" for i in range(32)]
    for _ in range(6):
        observe(policy, [outcome(n, 5, 3) for n in names])
    alone = policy.choose([greedy("r0")])[0]
    crowded = policy.choose([greedy(n) for n in names])
    assert alone > max(crowded) > 0


def test_the_prior_comes_from_the_drafters_recent_acceptance():
    policy = SpeculationPolicy(costs(draft_step=0.2), reference_draft_cost=0.1)
    for i in range(10):  # other requests found the drafter useless
        observe(policy, [outcome(f"old{i}", 5, 0)])
    newcomer = greedy("new")
    assert policy.alpha(newcomer) < 0.2 and policy.choose([newcomer]) == [0]


def test_seeded_requests_choose_from_their_own_history_only():
    """Timings, batch mates and the drafter's global record must not move a seeded request's K:
    the same own history gives the same K sequence whatever else happens."""
    def run(policy: SpeculationPolicy, company: int) -> list[int]:
        seeded = PolicyRequest("s", 5, greedy=False, seeded=True)
        others = [PolicyRequest(f"o{i}", 5, greedy=False, seeded=False) for i in range(company)]
        ks = []
        for round_index in range(30):
            k = policy.choose([seeded] + others)[0]
            ks.append(k)
            accepted = min(k, round_index % 4)  # the request's own (deterministic) outcomes
            observe(policy, [outcome("s", k, accepted)] + [outcome(o.req_id, 5, 0) for o in others], greedy=False)
        return ks

    alone = run(SpeculationPolicy(costs(), reference_draft_cost=0.1), company=0)
    busy = run(SpeculationPolicy(costs(draft_step=0.5, verify_slope=0.3), reference_draft_cost=0.1), company=12)
    assert alone == busy
    assert len(set(alone)) > 1  # and it does adapt, to its own acceptance


def test_round_costs_interpolate_and_follow_measurements():
    c = costs(draft_step=0.05, verify_slope=0.1)
    assert c.verify_seconds(1, 1) == pytest.approx(1.0)
    assert c.verify_seconds(1, 4) == pytest.approx(1.3)  # between grid points
    assert c.verify_seconds(1, 12) == pytest.approx(2.1)  # beyond the grid: the last slope
    assert c.draft_seconds([2, 2, 1]) == pytest.approx(0.15) and c.draft_seconds([]) == 0.0
    slow = RoundReport(updates=[outcome("a", 1, 1, asked=1)], ran=True, verify_seconds=2 * c.verify_seconds(1, 2),
                       draft_seconds=2 * c.draft_seconds([1]), total_seconds=10.0)
    for _ in range(60):
        c.observe(slow)
    assert c.verify_scale == pytest.approx(2.0, rel=0.01) and c.draft_scale == pytest.approx(2.0, rel=0.01)
    assert c.overhead_seconds == pytest.approx(10.0 - 2 * 1.1 - 2 * 0.05, rel=0.01)
    assert RoundCosts.from_json(c.to_json()).verify_scale == 1.0  # corrections are not cached


def test_one_verify_lookup_and_a_row_of_them_agree_below_within_and_beyond_the_grid():
    """observe() looks one pass up in plain Python, the policy a row of candidates with numpy."""
    c = costs(draft_step=0.05, verify_slope=0.1, batch_slope=0.02)
    c = RoundCosts(batch_sizes=c.batch_sizes, verify_tokens=[1, 2, 3, 7, 13],  # steps other than 1 (K up to 12)
                   verify_grid=[[0.3 + 0.17 * b + 0.011 * t ** 1.3 for t in (1, 2, 3, 7, 13)] for b in c.batch_sizes],
                   draft_step=c.draft_step)
    for batch in (1, 3, 8, 20, 40):
        tokens = [0.5, 1, 1.5, 2, 4.25, 6, 9, 12.5, 13, 15.3]
        row = c.grid_seconds(batch, np.array(tokens))
        assert [c.grid_seconds(batch, t) for t in tokens] == row.tolist()  # the same bits


def test_sampled_rounds_are_priced_and_corrected_apart_from_greedy_ones():
    """Sampling, q and the accept test make a sampled round dearer than the greedy grid says: the
    measured accept time and draft factor price it, and its online corrections leave the greedy
    figures alone."""
    c = costs(draft_step=0.05, verify_slope=0.1)
    c.sampled_draft_factor, c.sampled_batches, c.sampled_accept_seconds = 3.0, [1, 32], [0.2, 0.5]
    assert c.draft_seconds([1], sampled=True) == pytest.approx(3 * c.draft_seconds([1]))
    assert c.verify_seconds(1, 2, sampled=True) == pytest.approx(c.verify_seconds(1, 2) + 0.2)
    assert c.verify_seconds(8, 1, sampled=True) == pytest.approx(c.verify_seconds(8, 1))  # nothing to accept
    assert c.accept_seconds(32) == pytest.approx(0.5)
    # A machine twice as slow: sampled passes at K = 0 and with proposals (the accept test's share
    # as measured) take twice the estimate, and so do sampled draft steps.
    plain_round = RoundReport(updates=[outcome("s", 0, 0)], ran=True, verify_seconds=2 * c.verify_seconds(1, 1),
                              total_seconds=10.0)
    sampled_round = RoundReport(updates=[outcome("s", 1, 1, asked=1)], ran=True,
                                verify_seconds=2 * c.verify_seconds(1, 2, sampled=True),
                                draft_seconds=2 * c.draft_seconds([1], sampled=True), total_seconds=10.0)
    for _ in range(200):
        c.observe(plain_round, sampled=True)
        c.observe(sampled_round, sampled=True)
    assert c.sampled_verify_scale == pytest.approx(2.0, rel=0.01)
    assert c.verify_seconds(1, 2, sampled=True) == pytest.approx(2 * (c.verify_seconds(1, 2) + 0.2), rel=0.01)
    assert c.sampled_draft_scale == pytest.approx(2.0, rel=0.01)
    assert c.verify_scale == 1.0 and c.draft_scale == 1.0
    cached = RoundCosts.from_json(c.to_json())  # the measured figures are kept, the corrections not
    assert (cached.sampled_draft_factor, cached.sampled_accept_seconds) == (3.0, [0.2, 0.5])
    assert cached.sampled_draft_scale == 1.0


def test_an_accept_test_dearer_than_what_a_poor_draft_brings_stops_speculation():
    """A drafter that costs nothing (n-gram) with acceptance 0.1: one more verified token is
    nearly free at batch 1, so greedy requests draft; a sampled round pays the accept test too,
    more than the 10% it brings, so sampled requests decode plainly."""
    c = costs(draft_step=0.0, verify_slope=0.01)
    c.sampled_batches, c.sampled_accept_seconds = [1, 32], [0.15, 0.3]
    policy = SpeculationPolicy(c, reference_draft_cost=0.0, initial_prior=0.1)
    assert policy.choose([greedy("g")])[0] > 0
    assert policy.choose([PolicyRequest("s", 5, greedy=False, seeded=False)])[0] == 0


def test_a_draft_that_samples_slowly_is_not_used_for_sampled_requests():
    """The same acceptance pays for greedy requests but not for sampled ones whose draft steps
    cost six times as much (the policy prices a round by its kind)."""
    c = costs(draft_step=0.1, verify_slope=0.02)
    c.sampled_draft_factor = 6.0
    policy = SpeculationPolicy(c, reference_draft_cost=0.1, initial_prior=0.5)
    assert policy.choose([greedy("g")])[0] > 0
    assert policy.choose([PolicyRequest("s", 5, greedy=False, seeded=False)])[0] == 0


def test_a_draft_call_that_feeds_a_backlog_does_not_price_the_draft_steps():
    """A request back from K = 0 first feeds the drafter everything it committed meanwhile: that
    call is slow for a reason no later step shares, so it must not raise the per-step estimate."""
    c = costs(draft_step=0.05)
    back = RoundReport(updates=[outcome("a", 3, 1, asked=3)], ran=True, verify_seconds=c.verify_seconds(1, 4),
                       draft_seconds=20 * c.draft_seconds([1, 1, 1]), draft_catch_up=40, total_seconds=5.0)
    for _ in range(30):
        c.observe(back)
    assert c.draft_scale == 1.0
    c.observe(RoundReport(updates=back.updates, ran=True, verify_seconds=back.verify_seconds,
                          draft_seconds=back.draft_seconds, total_seconds=5.0))
    assert c.draft_scale > 1.0  # the same call without a backlog does count


def test_a_round_that_fed_prompts_leaves_the_verify_correction_alone():
    """A pass that first prefilled new requests takes a multiple of a verify pass's time: folded
    into the correction, it would inflate every verify estimate (and make drafting look cheap)."""
    c = costs()
    admitted = RoundReport(updates=[outcome("a", 0, 0)], ran=True, verify_seconds=50 * c.verify_seconds(1, 1),
                           target_prefill=300, total_seconds=60.0)
    c.observe(admitted)
    assert c.verify_scale == 1.0 and c.plain_verify_factor == 1.0
    c.observe(RoundReport(updates=admitted.updates, ran=True, verify_seconds=admitted.verify_seconds,
                          total_seconds=60.0))
    assert c.verify_scale > 1.0 and c.plain_verify_factor > 1.0  # the same pass without a prefill does count


def _batch_8_round(c: RoundCosts, k: int, verify_share: float) -> RoundReport:
    """A round of 8 requests at K = k whose verify pass took verify_share x the grid's estimate
    (and whose draft steps took the estimate)."""
    grid = c.grid_seconds(8, k + 1)
    draft = c.draft_seconds([8] * k)
    return RoundReport(updates=[outcome(f"r{i}", k, k) for i in range(8)], ran=True, draft_seconds=draft,
                       verify_seconds=verify_share * grid, total_seconds=verify_share * grid + draft)


def test_plain_rounds_cheaper_than_the_grid_says_end_a_marginal_draft_at_batch_8():
    """The grid prices a plain pass 30% above what it costs while drafting passes come out right
    (at batch 8 on the dev machine: 12.4 ms predicted, 10.2 measured). The plain-pass factor learns
    it from the plain rounds, the shared scale stays with the drafting ones, and the marginal
    draft (K = 1 at acceptance 0.35: +7% by the grid) gives way to plain decoding."""
    c = costs(draft_step=0.05, verify_slope=0.05, batch_slope=0.1)
    batch = [greedy(f"r{i}") for i in range(8)]
    assert SpeculationPolicy(c, reference_draft_cost=0.1, initial_prior=0.35).choose(batch) == [1] * 8
    for _ in range(300):
        c.observe(_batch_8_round(c, 0, 0.7))
        c.observe(_batch_8_round(c, 1, 1.0))
    assert c.plain_verify_factor == pytest.approx(0.7, rel=0.03)
    assert c.verify_scale == pytest.approx(1.0, rel=0.03)
    assert SpeculationPolicy(c, reference_draft_cost=0.1, initial_prior=0.35).choose(batch) == [0] * 8


def test_a_machine_slowed_down_is_seen_by_drafting_estimates_through_plain_rounds_alone():
    """Plain rounds only (drafting does not pay), on a machine 30% slower than at calibration: the
    shared scale takes most of the slowdown, so a drafting pass is not priced at the old speed
    (a correction per kind of pass left it there, and at batch 8 T = 0.8 the policy drafted at
    0.88x plain)."""
    c = costs(draft_step=0.05, verify_slope=0.05, batch_slope=0.1)
    drafting = c.verify_seconds(8, 2)
    for _ in range(200):
        c.observe(_batch_8_round(c, 0, 1.3))
    assert c.verify_seconds(8, 1) == pytest.approx(1.3 * c.grid_seconds(8, 1), rel=0.01)
    assert c.verify_seconds(8, 2) > 1.2 * drafting


def test_one_request_drafting_among_plain_ones_is_priced_by_its_length():
    """Attention pads every sequence of a pass to the longest: one request at K = 5 among seven at
    0 costs about what all eight at 5 do. Priced by the mean length (ragged_share 0) its drafting
    looks nearly free and pays; priced as measured (ragged_share 1) it does not."""
    def batch_ks(share: float) -> list[int]:
        c = costs(draft_step=0.01, verify_slope=0.05)
        c.ragged_share = share
        policy = SpeculationPolicy(c, reference_draft_cost=0.01, initial_prior=0.1)
        for _ in range(5):
            observe(policy, [outcome("good", 5, 5)] + [outcome(f"poor{i}", 5, 0) for i in range(7)])
        return policy.choose([greedy("good")] + [greedy(f"poor{i}") for i in range(7)])

    assert batch_ks(0.0)[0] > 0 and batch_ks(0.0)[1:] == [0] * 7
    assert batch_ks(1.0) == [0] * 8
    c = costs()
    c.ragged_share = 0.5
    assert c.effective_tokens(1.5, 6) == pytest.approx(3.75)


def test_a_probe_that_must_feed_a_long_backlog_waits_for_its_credit():
    """Requests long at K = 0 have committed many tokens the drafter has not seen; a probe first
    feeds all of them. The same probe that the credit pays for without a backlog is not afforded
    with one that costs more than the credit can ever hold."""
    def probes(backlog: int) -> int:
        policy = SpeculationPolicy(costs(draft_step=0.05), reference_draft_cost=0.1, initial_prior=0.05)
        count = 0
        for _ in range(400):
            requests = [PolicyRequest(f"r{i}", 5, greedy=True, seeded=False, backlog=backlog) for i in range(4)]
            ks = policy.choose(requests)
            count += max(ks) > 0
            observe(policy, [outcome(r.req_id, k, 0) for r, k in zip(requests, ks)])
        return count

    assert probes(0) > 0
    assert probes(100_000) == 0


def test_new_requests_do_not_feed_the_drafter_their_prompts_for_a_marginal_gain():
    """The drafter's catch-up on a request's prompt (or on what it committed at K = 0) is paid once
    and then serves the rest of the request: its price is spread over the rounds it pays back in.
    A batch whose drafting gains little on the prior does not pay for 8 prompts; a clear gain does."""
    def first_ks(alpha: float, backlog: int, remaining: int = 128) -> list[int]:
        policy = SpeculationPolicy(costs(draft_step=0.02, verify_slope=0.05), reference_draft_cost=0.1,
                                   initial_prior=alpha)
        policy.costs.catch_up_token_seconds = 0.002  # a prompt of 200 tokens: 0.4 target steps
        return policy.choose([PolicyRequest(f"r{i}", 5, greedy=True, seeded=False, backlog=backlog,
                                            remaining=remaining) for i in range(8)])

    marginal = 0.45
    assert max(first_ks(marginal, backlog=0)) > 0  # the drafter is up to date: speculating pays a little
    assert first_ks(marginal, backlog=200) == [0] * 8  # feeding 8 prompts first does not
    assert first_ks(marginal, backlog=200, remaining=100_000) == [0] * 8  # spread over PAYBACK_ROUNDS at most
    assert min(first_ks(0.85, backlog=200)) > 0  # a clear gain pays for the prompts
    assert first_ks(0.85, backlog=200, remaining=2) == [0] * 8  # ... unless the request is about to end


def test_catch_up_calls_price_the_catch_up_tokens():
    """The time a draft call takes beyond its steps, over the backlog it fed, is what a catch-up
    token costs; the step estimate is left alone."""
    c = costs(draft_step=0.05)
    back = RoundReport(updates=[outcome("a", 3, 1, asked=3)], ran=True, verify_seconds=c.verify_seconds(1, 4),
                       draft_seconds=c.draft_seconds([1, 1, 1]) + 40 * 0.002, draft_catch_up=40, total_seconds=5.0)
    for _ in range(80):
        c.observe(back)
    assert c.catch_up_token_seconds == pytest.approx(0.002, rel=0.01)
    assert c.catch_up_seconds(10) == pytest.approx(0.02, rel=0.01)
    assert c.draft_scale == 1.0


def test_an_unchanged_batch_keeps_its_choice_for_a_few_rounds_then_follows_the_costs():
    """choose() reuses its last batch choice while the requests and their estimates are the same,
    for at most REDECIDE_ROUNDS rounds: then a change in the measured costs shows."""
    policy = SpeculationPolicy(costs(draft_step=0.01), reference_draft_cost=0.1, initial_prior=0.8)
    requests = [greedy("a"), greedy("b")]
    first = policy.choose(requests)
    assert max(first) > 0
    policy.costs.draft_scale = 1000.0  # drafting became far too dear
    uses = [policy.choose(requests) for _ in range(REDECIDE_ROUNDS)]
    assert uses[0] == first and uses[-1] == [0, 0]
    assert policy.choose([greedy("a"), greedy("c")]) == [0, 0]  # other requests: decided anew


def skewed_costs(rng: np.random.Generator) -> RoundCosts:
    """Round costs with every correction, the accept test and a catch-up price away from 1 and 0."""
    c = costs(draft_step=rng.uniform(0.02, 0.5), verify_slope=rng.uniform(0.0, 0.3))
    c.sampled_batches, c.sampled_accept_seconds = [1, 32], [rng.uniform(0.0, 0.3), 0.5]
    c.draft_call_seconds, c.overhead_seconds = rng.uniform(0.0, 0.2), rng.uniform(0.0, 0.2)
    c.sampled_draft_factor, c.catch_up_token_seconds = rng.uniform(1.0, 2.0), rng.uniform(0.001, 0.02)
    for scale in ("verify_scale", "draft_scale", "sampled_verify_scale", "sampled_draft_scale",
                  "plain_verify_factor", "sampled_plain_verify_factor"):
        setattr(c, scale, rng.uniform(0.7, 1.4))
    return c


def test_a_lone_round_is_priced_as_the_batch_pricing_prices_a_batch_of_one():
    rng = np.random.default_rng(0)
    for _ in range(20):
        policy = SpeculationPolicy(skewed_costs(rng), reference_draft_cost=0.1)
        for sampled in (False, True):
            ks = np.arange(7)[:, None]  # [K, 1]: one candidate per K, a batch of one
            batch = policy._round_seconds(ks, sampled)
            lone = [policy.costs.lone_round_seconds(k, sampled) for k in range(7)]
            assert lone == pytest.approx(batch.tolist(), rel=1e-12)


def test_cost_lookups_in_plain_python_agree_with_numpy_between_and_beyond_the_grid():
    rng = np.random.default_rng(2)
    c = skewed_costs(rng)
    c.sampled_batches, c.sampled_accept_seconds = [1, 4, 32], [0.1, 0.25, 0.4]
    for batch in (0.5, 1, 2, 4, 7.5, 32, 40):
        assert c.accept_seconds(batch) == pytest.approx(np.interp(batch, [1, 4, 32], [0.1, 0.25, 0.4]), rel=1e-12)
    steps = [8, 8, 5, 1, 0]
    expected = (c.draft_call_seconds + np.interp(steps[:4], c.batch_sizes, c.draft_step).sum()) * c.draft_factor(True)
    assert c.draft_seconds(steps, sampled=True) == pytest.approx(expected, rel=1e-12)
    assert c.draft_seconds([0, 0]) == 0.0


def test_a_lone_request_gets_the_k_the_batch_choice_would_give_it():
    """At batch 1 the policy chooses in plain Python (_lone_choice); over random estimates, caps,
    costs, backlogs and both kinds of request it picks what the batch choice picks."""
    rng = np.random.default_rng(1)
    picked = set()
    for i in range(300):
        policy = SpeculationPolicy(skewed_costs(rng), reference_draft_cost=0.1)
        alpha, cap = float(rng.uniform(0.0, 0.999)), int(rng.integers(1, 9))
        request = PolicyRequest(f"r{i}", cap, greedy=bool(rng.integers(2)), seeded=False,
                                backlog=int(rng.choice([0, 0, 30, 400])), remaining=int(rng.integers(1, 300)))
        catch_up = policy._amortizable_catch_up([request], np.array([True]))
        batch = policy._batch_choice(np.array([alpha]), np.array([cap]), np.zeros(1, dtype=np.int64),
                                     np.array([True]), not request.greedy, catch_up)
        assert policy._lone_choice(request, alpha) == int(batch[0])
        picked.add(int(batch[0]))
    assert len(picked) >= 5  # the cases cover plain steps, short and long drafts


@pytest.fixture
def fake_clock(monkeypatch) -> list[float]:
    """round_costs' timer reads clock[0], which the fake workers of a test advance by what they cost."""
    from types import SimpleNamespace

    from coordinator import round_costs

    clock = [0.0]
    monkeypatch.setattr(round_costs, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    return clock


def test_calibration_measures_the_share_of_padding_a_ragged_pass_pays(fake_clock):
    """Against a target whose ragged passes cost their mean length's pass plus 40% of the way to
    the longest one's, the start-up timing finds 0.4 (a fake clock: the target's cost, no noise)."""
    from coordinator import round_costs
    from specdec.params import SamplingParams
    from specdec.round_types import VerifyOutcome, VerifyResult

    clock = fake_clock

    class PaddingTarget:
        def __init__(self):
            self.released = []

        def verify(self, tasks, finished):
            self.released += finished
            if tasks and not tasks[0].new_tokens:
                fed = np.array([len(t.draft_tokens) + 1 for t in tasks])
                mean, longest = fed.mean(), fed.max()
                clock[0] += 1.0 + 0.1 * len(tasks) * ((mean - 1) + 0.4 * (longest - mean))
            return VerifyResult([VerifyOutcome(t.req_id, 0, [1]) for t in tasks], 0, 100)

    target = PaddingTarget()
    share = round_costs._ragged_share(target, 8, 6, 2, SamplingParams(max_new_tokens=99), 64,
                                      np.random.default_rng(0), 100)
    assert share == pytest.approx(0.4)
    assert sorted(target.released) == sorted(f"calibrate-ragged-{i}" for i in range(8))


def test_calibration_prices_a_catch_up_token_from_one_call_that_feeds_prompts(fake_clock):
    """A drafter whose call costs 2 ms a step plus 0.05 ms per token it must first catch up on:
    the start-up timing finds 0.05 ms (fake clock), and every throw-away request is released."""
    from coordinator import round_costs
    from specdec.params import SamplingParams
    from specdec.round_types import DraftProposal, VerifyOutcome, VerifyResult

    clock = fake_clock

    class Target:
        def verify(self, tasks, finished):
            return VerifyResult([VerifyOutcome(t.req_id, 0, [1]) for t in tasks], 0, 100)

    class Drafter:
        released: list[str] = []

        def propose(self, tasks, finished):
            self.released += finished
            clock[0] += sum(0.00005 * len(t.new_tokens) for t in tasks) + 0.002 * max(
                [t.num_speculative_tokens for t in tasks], default=0)
            return [DraftProposal(t.req_id, [1] * t.num_speculative_tokens, None, t.num_speculative_tokens)
                    for t in tasks]

    drafter = Drafter()
    per_token = round_costs._catch_up_token_seconds(Target(), drafter, 4, 100, SamplingParams(max_new_tokens=99),
                                                    np.random.default_rng(0), 100, one_step_seconds=0.002)
    assert per_token == pytest.approx(0.00005, rel=0.02)  # (the prefill's committed token is fed too)
    assert sorted(drafter.released) == sorted(f"calibrate-catch-up-{i}" for i in range(4))
    c = costs()
    c.catch_up_token_seconds, c.sampled_draft_factor = 0.00005, 3.0
    assert c.catch_up_seconds(200, sampled=True) == pytest.approx(0.01)  # no sampled factor: nothing is sampled


def test_calibration_times_sampled_rounds_as_paired_differences_from_greedy_ones(fake_clock):
    """The accept test's time and the sampled draft factor come from greedy and sampled rounds
    of the same shape run back to back: against a target whose sampled passes take 3 ms more and a
    drafter whose sampled calls take 2.5x as long, on a machine that slows down as it goes (each
    call dearer than the last), the paired medians find 3 ms and 2.5."""
    from coordinator import round_costs
    from specdec.params import SamplingParams
    from specdec.round_types import DraftProposal, VerifyOutcome, VerifyResult

    clock, calls = fake_clock, [0]

    def spend(seconds: float) -> None:
        calls[0] += 1
        clock[0] += seconds * (1 + 0.001 * calls[0])  # a drifting machine

    class Target:
        def verify(self, tasks, finished):
            if tasks and not tasks[0].new_tokens:
                spend(0.010 + (0.003 if tasks[0].params.temperature > 0 else 0.0))
            return VerifyResult([VerifyOutcome(t.req_id, 0, [1]) for t in tasks], 0, 100)

    class Drafter:
        def propose(self, tasks, finished):
            if tasks:
                spend(0.002 * (2.5 if tasks[0].params.temperature > 0 else 1.0))
            return [DraftProposal(t.req_id, [], None, 0) for t in tasks]

    greedy = SamplingParams(max_new_tokens=99)
    sampled = SamplingParams(max_new_tokens=99, temperature=1.0, seed=0)
    accept, factor = round_costs._sampled_extra(Target(), Drafter(), 2, 3, 5, greedy, sampled, 16,
                                                np.random.default_rng(0), 100)
    assert accept == pytest.approx(0.003, rel=0.05) and factor == pytest.approx(2.5, rel=0.02)


def test_a_verify_row_measured_falling_is_bounded_so_drafting_never_looks_cheaper():
    """At batch 1 a pass costs the same for 1 to 6 tokens up to noise; a row whose cells fell by
    chance would make every draft token look like a saving. Each cell is bounded by the cheapest
    after it (timings only err upwards): a spike in the plain cell cannot make drafting look free."""
    c = RoundCosts(batch_sizes=[1, 8], verify_tokens=[1, 2, 3, 4],
                   verify_grid=[[3.8, 3.6, 3.3, 3.5], [31.7, 17.3, 14.9, 17.5]], draft_step=[0.0, 0.0])
    assert [c.grid_seconds(1, t) for t in (1, 2, 3, 4)] == pytest.approx([3.3, 3.3, 3.3, 3.5])
    assert [c.grid_seconds(8, t) for t in (1, 2, 3, 4)] == pytest.approx([14.9, 14.9, 14.9, 17.5])
    assert c.verify_grid[0] == [3.8, 3.6, 3.3, 3.5]  # the measurements themselves are kept
    c.sampled_batches, c.sampled_accept_seconds = [1], [0.7]
    policy = SpeculationPolicy(c, reference_draft_cost=0.0, initial_prior=0.07)
    assert policy.choose([PolicyRequest("s", 5, greedy=False, seeded=False)]) == [0]
