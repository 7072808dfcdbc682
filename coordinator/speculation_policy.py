"""How many tokens each running request drafts this round: K from 0 (plain decoding) up to its cap.

Terms:
- alpha: per-token acceptance, the chance the target keeps a draft token once the ones before it
  were kept. A round of K commits on average E(alpha, K) = 1 + alpha + ... + alpha^K tokens
  (the last one the target's own), so the value of a request's k-th draft token is alpha^k.
- a request's alpha estimate: its own accepted / tested draft tokens (tested = the accepted ones
  plus the first rejected one), both decayed by DECAY per round, plus a prior worth PRIOR_WEIGHT
  tokens. The prior is the drafter's recent acceptance over all requests of the same kind
  (greedy or sampled). A round at K = 0 decays the evidence too: what a request showed ten rounds
  ago fades towards the prior whether or not it drafted since. (Kept, a sampled request that met
  a run of rejections sat below break-even with nothing to change its estimate: at batch 1,
  T = 0.8, 94% of rounds at K = 0 where drafting every round paid 1.1x.)
- round time: RoundCosts' prediction for the whole batch (draft steps, verify pass, overhead).

The batch choice maximises expected committed tokens per second, sum_i E_i / round time, over a
family of candidates: K_i = #{k <= cap_i : alpha_i^k >= theta} for every threshold theta among the
requests' own alpha_i^k values (theta above all of them: everyone decodes plainly). At an optimum
every kept token is worth more than its marginal cost, and that cost is nearly the same for every
request of a round, so a common threshold is where the optimum lies; evaluating each candidate's
full predicted time takes care of the draft steps that requests share.

A request whose drafter lags (a new one: its prompt; one back from K = 0: the tokens committed
meanwhile) makes the drafter catch up before it drafts. That one-time cost buys speculation for
the rest of the request, so a candidate that drafts for it pays the catch-up amortized over the
rounds it pays back in: the request's remaining tokens / E, at most PAYBACK_ROUNDS. Unpriced, a
batch of new requests whose estimated gain is marginal (prose at batch 8) started speculating on
the prior and fed the drafter 8 prompts first: one call of 100 ms, six plain rounds' time.

Seeded sampled requests are the exception. Which random draws decide a token depends on K (a
token proposed and accepted uses other draws than one sampled plainly), so a seeded request's K
must be a function of its own history only, never of timings or batch mates: it maximises its own
E / cost with fixed reference costs (a draft step costs the draft/target parameter ratio of a
target step, each verified token REFERENCE_VERIFY_TOKEN_COST), from a constant prior.

Probing: at K = 0 a request learns nothing about acceptance, so after `probe_after` rounds at 0
it drafts its full cap once (the most evidence a round can give); a probe that does not bring it
back doubles the wait, up to MAX_PROBE_AFTER rounds. Unseeded requests probe together: when one
is due, every unseeded request at 0 probes in the same round, so a batch pays for one draft call
per probe round instead of one for each request's own clock. And they probe on a budget: a probe
round's net cost (its predicted time beyond what its expected tokens are worth at the plain
round's rate; the drafter's catch-up on what the probing requests committed at K = 0 included)
is paid from a credit that every round in which a probe is due adds PROBE_SHARE of its predicted
time to, so probing a draft that never pays costs at most about that share of
throughput (at batch 8 on the dev machine, each request probing on its own clock cost 12% on
prose). Seeded
requests keep their own clocks and no budget: their K may depend on their own history only.

choose() changes no state: a round that then fails (a worker died) leaves the policy as it was,
and observe() records what the round that ran actually did. It keeps one memo: the same requests
with the same caps and estimates get the same batch choice and probe pricing for up to
REDECIDE_ROUNDS rounds (the cost corrections move a few percent a round), so a batch that sits
at K = 0, where no round brings evidence, does not pay the policy's numpy time on every round
(about 0.2 ms, 3% of a batch-8 round on the dev machine). The key holds seeded requests' estimates
exactly (and the others' to 2 decimals): a seeded request's K sequence thus depends on its
committed rounds only, however often a round had to be retried. It leaves out backlogs and
remaining tokens: a catch-up's price moves little from one round to the next, and a request that
caught up brings new evidence, hence a new key.

The fading of evidence at K = 0 lets a request come back on its merits once its estimate is near
the drafter's recent rate again, outside the probe budget. That is meant: when that rate is
above break-even, a request that met a run of rejections is more likely unlucky than bad, and
its return is one round at the small K an estimate just above break-even earns. The budget
bounds what probing costs when the rate itself is below break-even (a drafter bad at the
traffic), where no estimate drifts above it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coordinator.decayed_rate import DecayedRate
from coordinator.round_costs import RoundCosts
from coordinator.round_report import RoundReport

DECAY = 0.8  # weight of a request's last round's evidence relative to this round's
GLOBAL_DECAY = 0.98  # the same for the drafter's record over all requests: a longer memory
PRIOR_WEIGHT = 4.0  # tested tokens the prior counts for: one unlucky round must not end speculation
SEEDED_PRIOR = 0.6  # the constant prior of seeded sampled requests
REFERENCE_VERIFY_TOKEN_COST = 0.1  # one more verified token, in target steps (seeded requests)
PROBE_AFTER, MAX_PROBE_AFTER = 4, 16
PROBE_SHARE = 0.02  # of the predicted round time that unseeded probes may spend
# The probe credit holds at most this many rounds' worth (2 rounds' time): no burst of probes, and
# no probe dearer than that (one whose catch-up on a long backlog, e.g. a prompt the drafter never
# saw, costs more is never made: at batch 8 that one call took 5% of a 128-token run).
CREDIT_ROUNDS = 100
REDECIDE_ROUNDS = 8  # the most rounds a memoized choice is reused for
# The most rounds a drafter's catch-up is amortized over: requests often end (EOS) long before
# max_new_tokens, so a catch-up that only pays back over hundreds of rounds is not worth it.
PAYBACK_ROUNDS = 64
_ALPHA_MAX = 0.999  # keeps E finite and the log-threshold algebra away from alpha = 1


@dataclass
class _Memo:
    """What choose() computed for one set of requests and estimates (see the module docstring)."""

    key: tuple
    chosen: np.ndarray  # K per request before probing
    probe_seconds: np.ndarray | None = None  # predicted round without and with the probe, [2]
    probe_tokens: np.ndarray | None = None  # their expected committed tokens, [2]
    uses: int = 0


@dataclass(frozen=True)
class PolicyRequest:
    req_id: str
    cap: int  # the most this request may draft this round (its max, near-end and context limits)
    greedy: bool
    seeded: bool  # a seeded sampled request: K from its own history only
    backlog: int = 0  # tokens the drafter has not seen beyond one round's worth (a prompt; K = 0 rounds)
    remaining: int = 1 << 30  # tokens the request may still commit (max_new_tokens less those generated)


@dataclass
class _Evidence(DecayedRate):
    """A request's acceptance record (successes: accepted draft tokens, trials: tested ones) and
    its probe clock."""

    decay: float = DECAY
    prior_weight: float = PRIOR_WEIGHT
    rounds_at_zero: int = 0
    probe_after: int = PROBE_AFTER

    def alpha(self, prior: float) -> float:
        return min(max(self.rate(prior), 0.0), _ALPHA_MAX)


def expected_tokens(alpha: float | np.ndarray, k: int | np.ndarray) -> float | np.ndarray:
    """E(alpha, K) = (1 - alpha^(K+1)) / (1 - alpha), elementwise or on plain numbers (alpha < 1)."""
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class SpeculationPolicy:
    def __init__(self, costs: RoundCosts, reference_draft_cost: float, initial_prior: float = 0.6):
        self.costs = costs
        self.reference_draft_cost = reference_draft_cost  # draft step / target step, seeded requests
        self._evidence: dict[str, _Evidence] = {}
        # The drafter's recent acceptance, greedy and sampled, as the prior of new requests.
        self._global = {True: _Evidence(GLOBAL_DECAY), False: _Evidence(GLOBAL_DECAY)}
        self._initial_prior = initial_prior
        self._chosen: dict[str, str] = {}  # req_id -> why its K was chosen: "merit" | "probe" | "zero"
        self._probe_credit = 0.0  # seconds that unseeded probes may still spend
        self._credit_change = 0.0  # what the chosen round adds to (or takes from) it, once it ran
        self._credit_cap = 0.0  # the most it may hold after the chosen round
        self._memo: _Memo | None = None

    # -- estimates ------------------------------------------------------------------------------
    def _priors(self) -> dict[bool, float]:
        """The drafter's recent acceptance, greedy (True) and sampled (False)."""
        return {greedy: record.alpha(self._initial_prior) for greedy, record in self._global.items()}

    def prior(self, request: PolicyRequest, priors: dict[bool, float] | None = None) -> float:
        if request.seeded:
            return SEEDED_PRIOR
        return (priors or self._priors())[request.greedy]

    def alpha(self, request: PolicyRequest, priors: dict[bool, float] | None = None) -> float:
        """(`priors`: _priors() when the caller already has them.)"""
        return self._own(request.req_id).alpha(self.prior(request, priors))

    def _own(self, req_id: str) -> _Evidence:
        """A request's record, made on first use (not setdefault: a throw-away record each call
        was a tenth of the policy's round time)."""
        evidence = self._evidence.get(req_id)
        if evidence is None:
            evidence = self._evidence[req_id] = _Evidence()
        return evidence

    def observe(self, report: RoundReport, greedy: dict[str, bool]) -> None:
        """Fold a round's outcomes into the estimates (`greedy`: req_id -> greedy request)."""
        if self._credit_change:
            self._probe_credit = min(max(self._probe_credit + self._credit_change, 0.0), self._credit_cap)
        self._credit_change = 0.0
        for update in report.updates:
            why = self._chosen.pop(update.req_id, None)
            if update.finished:
                self._evidence.pop(update.req_id, None)
            elif why is not None:
                self._track_zero_rounds(self._own(update.req_id), why)
            if update.proposed == 0:
                continue
            tested = update.accepted + (1 if update.accepted < update.proposed else 0)
            if not update.finished:
                self._own(update.req_id).add(update.accepted, tested)
            if update.req_id in greedy:
                self._global[greedy[update.req_id]].add(update.accepted, tested)
        self.costs.observe(report, sampled=any(not greedy.get(u.req_id, True) for u in report.updates))

    def export(self, req_id: str) -> _Evidence | None:
        """A request's own history, to carry to another replica's policy (`adopt`): a seeded
        request's K must stay a function of its own history wherever it runs."""
        return self._evidence.get(req_id)

    def adopt(self, req_id: str, evidence: _Evidence) -> None:
        self._evidence[req_id] = evidence

    def forget(self, req_id: str) -> None:
        self._evidence.pop(req_id, None)
        self._chosen.pop(req_id, None)

    @staticmethod
    def _track_zero_rounds(evidence: _Evidence, why: str) -> None:
        if why == "merit":  # speculating on its own merits (again)
            evidence.rounds_at_zero, evidence.probe_after = 0, PROBE_AFTER
        elif why == "probe":
            evidence.rounds_at_zero = 0
            evidence.probe_after = min(2 * evidence.probe_after, MAX_PROBE_AFTER)
        else:
            evidence.rounds_at_zero += 1
            evidence.add(0.0, 0.0)  # nothing tested: the past fades

    # -- the choice -----------------------------------------------------------------------------
    def choose(self, requests: list[PolicyRequest]) -> list[int]:
        self._chosen.clear()  # a round that never ran leaves no trace
        self._credit_change = 0.0
        if not requests:
            return []
        priors = self._priors()
        alphas = [self.alpha(r, priors) for r in requests]
        # Unseeded estimates to 2 decimals (at K = 0 they drift towards the prior by ever smaller
        # steps); seeded ones exactly, so a seeded K is always its own estimate's.
        key = (tuple((r.req_id, r.cap, r.greedy, r.seeded) for r in requests),
               tuple(a if r.seeded else round(a, 2) for r, a in zip(requests, alphas)))
        memo = self._memo
        if memo is None or memo.key != key or memo.uses >= REDECIDE_ROUNDS:
            memo = self._memo = _Memo(key, self._choose_anew(requests, np.array(alphas)))
        memo.uses += 1
        chosen = memo.chosen
        at_zero = [k == 0 and not r.seeded and r.cap > 0 for r, k in zip(requests, chosen)]  # who would probe
        due = any(self._due(r) for r, zero in zip(requests, at_zero) if zero)
        if due:
            due = self._afford_probe(requests, np.array(alphas), memo, at_zero)
        return [self._with_probe(r, int(k), together=due and not r.seeded) for r, k in zip(requests, chosen)]

    def _choose_anew(self, requests: list[PolicyRequest], alphas: np.ndarray) -> np.ndarray:
        """K per request before probing: seeded ones by their own rule, the others together."""
        if len(requests) == 1 and not requests[0].seeded and requests[0].cap > 0:
            return np.array([self._lone_choice(requests[0], float(alphas[0]))])
        caps = np.array([max(r.cap, 0) for r in requests])
        seeded = np.array([r.seeded for r in requests])
        chosen = np.zeros(len(requests), dtype=np.int64)
        chosen[seeded] = [self._own_choice(a, c) for a, c in zip(alphas[seeded], caps[seeded])]
        free = ~seeded & (caps > 0)
        if free.any():
            catch_up = self._amortizable_catch_up(requests, free)
            chosen[free] = self._batch_choice(alphas, caps, chosen, free, self._sampled(requests), catch_up)
        return chosen

    def _amortizable_catch_up(self, requests: list[PolicyRequest], free: np.ndarray) -> tuple | None:
        """(catch-up seconds, remaining tokens) of the `free` requests; None when none lags."""
        lagging = [r for r, f in zip(requests, free) if f]
        if not any(r.backlog for r in lagging):
            return None
        sampled = self._sampled(requests)
        return (np.array([self.costs.catch_up_seconds(r.backlog, sampled) for r in lagging]),
                np.array([r.remaining for r in lagging], dtype=np.float64))

    @staticmethod
    def _sampled(requests: list[PolicyRequest]) -> bool:
        return not all(r.greedy for r in requests)

    def _afford_probe(self, requests: list[PolicyRequest], alphas: np.ndarray, memo: _Memo,
                      probing: list[bool]) -> bool:
        """Does the probe credit cover probing the `probing` requests (every unseeded one at 0)
        this round, the drafter first catching up on their backlogs? Records the round's credit
        change either way (applied by observe, once the round ran)."""
        sampled = self._sampled(requests)
        if memo.probe_seconds is None:
            chosen = memo.chosen
            ks = np.stack([chosen, np.where(probing, [r.cap for r in requests], chosen)])
            memo.probe_seconds = self._round_seconds(ks, sampled)
            memo.probe_tokens = expected_tokens(alphas[None, :], ks).sum(axis=1)
        seconds, tokens = memo.probe_seconds.copy(), memo.probe_tokens
        seconds[1] += self.costs.catch_up_seconds(sum(r.backlog for r, p in zip(requests, probing) if p), sampled)
        net_cost = max(seconds[1] - tokens[1] * seconds[0] / tokens[0], 0.0)
        self._credit_change = PROBE_SHARE * seconds[0]
        self._credit_cap = CREDIT_ROUNDS * PROBE_SHARE * seconds[0]
        if min(self._probe_credit, self._credit_cap) + self._credit_change < net_cost:
            return False
        self._credit_change -= net_cost
        return True

    def _own_choice(self, alpha: float, cap: int) -> int:
        ks = np.arange(cap + 1)
        cost = 1.0 + ks * (self.reference_draft_cost + REFERENCE_VERIFY_TOKEN_COST)
        return int(np.argmax(expected_tokens(np.full(len(ks), alpha), ks) / cost))

    def _batch_choice(self, alphas: np.ndarray, caps: np.ndarray, fixed: np.ndarray, free: np.ndarray,
                      sampled: bool, catch_up: tuple | None = None) -> np.ndarray:
        """K of the `free` requests maximising sum E / round time; the others keep `fixed`
        (`sampled`: a round with sampled requests, priced as such; `catch_up`: the free requests'
        catch-up seconds [F] and remaining tokens [F], amortized as the module docstring says)."""
        top = int(caps[free].max())
        ks = np.arange(1, top + 1)
        values = alphas[free, None] ** ks[None, :]  # [F, top]: the worth of each draft token
        values[ks[None, :] > caps[free, None]] = -1.0  # beyond a cap: never taken
        thresholds = np.array(sorted(set(values[values > 0].tolist())) + [np.inf])  # (np.unique: 10x slower here)
        candidates = (values[None, :, :] >= thresholds[:, None, None]).sum(axis=2)  # [C, F]
        everyone = np.broadcast_to(fixed, (len(thresholds), len(fixed))).copy()
        everyone[:, free] = candidates
        seconds = self._round_seconds(everyone, sampled)
        if catch_up is not None:
            lag_seconds, remaining = catch_up
            gain = expected_tokens(alphas[free][None, :], candidates)  # [C, F]
            payback = np.clip(remaining[None, :] / gain, 1.0, PAYBACK_ROUNDS)
            seconds = seconds + (np.where(candidates > 0, lag_seconds[None, :], 0.0) / payback).sum(axis=1)
        rates = expected_tokens(alphas[None, :], everyone).sum(axis=1) / seconds
        return candidates[int(np.argmax(rates))]

    def _lone_choice(self, request: PolicyRequest, alpha: float) -> int:
        """_batch_choice for a batch of one unseeded request, in plain Python (at batch 1 the
        numpy version's fixed costs were most of the policy's time): the K of the best rate, the
        deepest of equal ones, as there."""
        sampled = not request.greedy
        lag = self.costs.catch_up_seconds(request.backlog, sampled) if request.backlog else 0.0
        best_k, best_rate = 0, -1.0
        for k in range(request.cap, -1, -1):
            if k and alpha ** k <= 0.0:  # a token worth nothing is no candidate (values > 0 there)
                continue
            gain = expected_tokens(alpha, k)
            seconds = self.costs.lone_round_seconds(k, sampled)
            if k and lag:
                seconds += lag / min(max(request.remaining / gain, 1.0), PAYBACK_ROUNDS)
            rate = gain / seconds
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def _round_seconds(self, ks: np.ndarray, sampled: bool) -> np.ndarray:
        """Predicted seconds of a round for each candidate row of ks [C, B]."""
        costs = self.costs
        verify = costs.verify_seconds(ks.shape[1], costs.effective_tokens(ks.mean(axis=1) + 1, ks.max(axis=1) + 1),
                                      sampled)
        drafting = (ks[:, :, None] > np.arange(int(ks.max()))[None, None, :]).sum(axis=1)  # [C, steps]
        draft = (costs.draft_steps_by_count(ks.shape[1])[drafting].sum(axis=1)
                 + costs.draft_call_seconds * (ks.max(axis=1) > 0))
        return verify + draft * costs.draft_factor(sampled) + costs.overhead_seconds

    def _due(self, request: PolicyRequest) -> bool:
        """Has this request waited at K = 0 for as long as its probe clock says?"""
        evidence = self._evidence.get(request.req_id) or _Evidence()
        return request.cap > 0 and evidence.rounds_at_zero + 1 >= evidence.probe_after

    def _with_probe(self, request: PolicyRequest, k: int, together: bool) -> int:
        """K after probing: a seeded request at 0 that is due drafts its cap, and so does every
        unseeded one at 0 when `together` (one of them is due and the probe credit allows)."""
        if request.cap == 0:
            return 0
        if k > 0:
            why = "merit"
        elif together or (request.seeded and self._due(request)):
            why, k = "probe", request.cap
        else:
            why = "zero"
        self._chosen[request.req_id] = why
        return k
