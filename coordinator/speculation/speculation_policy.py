"""How many tokens each running request drafts this round (K, 0: plain decoding), and in what shape.

The model:
- A request's k-th asked token is worth coverage * first * alpha^(k - 1) committed tokens:
  coverage, the share of asked tokens the drafter proposes (1 for a model; an n-gram lookup may
  find nothing: no rejection, a lookup's cost); alpha, a proposed token's acceptance; first, the
  first token's: its own rate after a round that rejected a token (greedy: a draft just wrong is
  wrong again 0.4-0.7 of the time, else 0.03-0.14), else alpha. A tree's other b - 1 root children,
  grown m deep, are worth coverage * (1 - first) * side * alpha^(j - 1) at depth j (side: one of
  them kept where the first child was rejected), for b - 1 nodes a depth.
- Each rate = (hits + w * prior) / (trials + w); a token is tested up to the first rejected one.
  The counts fade by DECAY every round the request takes part in (at K = 0 too: old evidence gives
  way to the prior). The prior is the pool: the same rates over all requests of one kind (greedy
  or sampled), fading by DECAY per w tokens, from INITIAL_ACCEPTANCE and coverage 1. w is the
  kind's (coverage's: PRIOR_WEIGHT): of PRIOR_WEIGHT * 2^j, the one best predicting recent tokens.
- A round's seconds: RoundCosts, learnt online. A drafter's catch-up serves every token its
  request may still commit: a round pays its share.
- The choice maximises committed tokens per second over the batch: draft tokens and a tree's depths
  of other children are added in decreasing order of worth a node and the best prefix wins (draft
  steps are shared by the batch). A round where no token could pay even at each rate's ceiling (a
  bound, else the choice) settles the next ones while nothing that could change that changes.
- Probes keep K = 0 from being a trap: once a kind has had no drafting round for its probe
  interval, its request longest without drafting (the smaller backlog among equals) drafts 1
  token, and if it was accepted 2 the round after (the probe paid the catch-up; rounds of 1 token
  price each step as a whole call, for they cannot tell the two apart: a long K would never pay).
  The interval starts at 2 rounds, doubles up to MAX_PROBE_INTERVAL (then x 0.5-1.5 by the golden
  ratio's multiples mod 1: never a period for traffic to lock to) after each probe that brings no
  request back, resets when one drafts on merit, and counts in plain rounds' worth of the probe's
  price (a dear probe costs no more of the time). No probe while acceptance 1 could not pay.
- Seeded sampled requests' K follows their own history only (which draws decide a token depends
  on K): the best expected tokens / (1 + nodes (c + REFERENCE_VERIFY_TOKEN_COST)), in target
  steps, c = draft/target parameter ratio, from the constant priors, a tree as set, probing on
  its own clock; never the pool, the batch, or a timing.
choose() leaves the estimates as they were (a round that then fails changes nothing).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter
from typing import NamedTuple

from coordinator.rounds.round_report import RoundReport
from coordinator.speculation.round_costs import COST_MEMORY, RoundCosts, RoundShape
from specdec.sampling.tree import side_branch_depth, tree_size

PRIOR_WEIGHT = 4.0  # tested tokens the prior counts for: one unlucky round must not end speculation
DECAY = 0.9  # a request's evidence per round: acceptance shifts within a request (code, then prose)
INITIAL_ACCEPTANCE = 0.6  # the pool's prior before any evidence, and seeded requests' prior
MAX_PROBE_INTERVAL = 64  # rounds: probing a drafter that never pays costs about 1 round in this many
REFERENCE_VERIFY_TOKEN_COST = 0.1  # one more verified token, in target steps (seeded requests' rule)
_RATE_MAX = 0.999  # an acceptance's: keeps E finite


class Estimate(NamedTuple):
    """What a request's drafts are worth (the model above)."""
    alpha: float  # acceptance of a draft token (but for the first where it has its own rate)
    coverage: float  # the share of asked tokens the drafter proposes
    first: float  # acceptance of the first token (alpha where it has no rate of its own)
    side: float = 0.0  # a tree's: another root child kept, where the first was rejected

    @property
    def others(self) -> Estimate:
        """What a tree's other children at depths 1, 2... are worth, as an Estimate of a chain."""
        return self._replace(first=(1.0 - self.first) * self.side)

    def ceiling(self, prior: Estimate) -> Estimate:
        """Each worth at its largest while the rates move to `prior` at K = 0 (a first priced at alpha)."""
        top = Estimate(*map(max, self, prior))
        first, least = max(top.first, top.alpha), min(self.first, self.alpha, prior.alpha)
        return top._replace(first=first, side=(1.0 - least) * top.side / (1.0 - first))

    def worth(self, k: int) -> float:
        """Committed tokens the k-th asked token adds."""
        return self.coverage * self.first * self.alpha ** (k - 1)

    def worth_up_to(self, k: int) -> float:
        """Committed tokens the first k asked tokens add: coverage first (1 + ... + alpha^(k-1))."""
        return self.coverage * self.first * (1.0 - self.alpha ** k) / (1.0 - self.alpha)

    def expected_tokens(self, k: int, side: int = 0) -> float:
        """Tokens a round commits drafting k tokens (and a tree's other children `side` depths deep)."""
        return 1.0 + self.worth_up_to(k) + (self.others.worth_up_to(side) if side else 0.0)


def _initial() -> Estimate:
    """The pool's prior before any evidence, and seeded requests' prior."""
    return Estimate(INITIAL_ACCEPTANCE, 1.0, INITIAL_ACCEPTANCE, INITIAL_ACCEPTANCE)


class PolicyRequest(NamedTuple):
    req_id: str
    cap: int  # the most this request may draft this round (its max, near-end and context limits)
    greedy: bool
    seeded: bool  # a seeded sampled request: K from its own history only
    backlog: int = 0  # committed tokens the drafter has not seen beyond one round's worth
    remaining: int = 1  # tokens it may still commit (1: a catch-up is charged whole to one round)


@dataclass
class Faded:
    """Hits of trials (model above), each round's added after the past's fade."""
    hits: float = 0.0
    trials: float = 0.0

    def add(self, hits: float, trials: float, fade: float) -> None:
        self.hits, self.trials = fade * self.hits + hits, fade * self.trials + trials

    def rate(self, prior: float, weight: float, most: float = _RATE_MAX) -> float:
        return min((self.hits + weight * prior) / (self.trials + weight), most)  # (<= 1: hits <= trials)


class PriorWeight:
    """A kind's prior weight w (the model above): the candidate whose rates erred least (squared) on
    recent tokens (faded by DECAY per largest candidate's tokens: unfaded, a server's first traffic
    ruled). Requests alike (sampled): their few own tokens are noise, K on them a winner's curse."""

    def __init__(self):
        self.errors, self.weight = [0.0] * 7, PRIOR_WEIGHT  # errors by j: of PRIOR_WEIGHT * 2^j (never below)

    def score(self, own: Evidence, hits: int, trials: int, prior: float) -> None:
        """A round's tokens of alpha against the request's rate before it."""
        fade = DECAY ** (trials / (PRIOR_WEIGHT * 2 ** (len(self.errors) - 1)))
        for j in range(len(self.errors)):
            p = own.alpha.rate(prior, PRIOR_WEIGHT * 2 ** j)
            self.errors[j] = fade * self.errors[j] + hits * (1.0 - p) ** 2 + (trials - hits) * p * p
        self.weight = PRIOR_WEIGHT * 2 ** min(range(len(self.errors)), key=self.errors.__getitem__)


@dataclass
class Evidence:
    """A request's (or a kind's) rounds, faded: each rate's hits of trials (alpha: accepted of tested
    tokens but the first's where it has a rate of its own; side: kept of tried; coverage: proposed of
    asked); whether the last round rejected a token; a probe clock (rounds at 0, interval, probes)."""
    alpha: Faded = field(default_factory=Faded)
    first: Faded = field(default_factory=Faded)
    side: Faded = field(default_factory=Faded)
    coverage: Faded = field(default_factory=Faded)
    rounds_at_zero: int = 0
    interval: int = 2
    probes: int = 0  # probed() calls: they pick the stretch of a longest interval (the model above)
    missed: bool = False  # the last round rejected a proposed token (a chain's next first: `first`)

    def add(self, counts: tuple[float, ...], fade: float | None = None, coverage_fade: float | None = None) -> None:
        """counts: hits and trials of alpha, first, side and coverage, in that order (fade: DECAY's)."""
        fade = DECAY if fade is None else fade
        for rate, hits, trials in zip((self.alpha, self.first, self.side), counts[0:6:2], counts[1:6:2]):
            rate.add(hits, trials, fade)
        self.coverage.add(counts[6], counts[7], fade if coverage_fade is None else coverage_fade)

    def probed(self, brought_back: bool) -> None:
        self.rounds_at_zero, self.interval = 0, 2 if brought_back else min(2 * self.interval, MAX_PROBE_INTERVAL)
        self.probes += 1

    def probe_due(self, price_in_rounds: float = 1.0) -> bool:
        stretch = 0.5 + self.probes * 0.6180339887 % 1.0 if self.interval == MAX_PROBE_INTERVAL else 1.0
        return self.rounds_at_zero + 1 >= self.interval * price_in_rounds * stretch


_NO_EVIDENCE = Evidence()  # (read only) a request's before its first round
_NO_COUNTS = (0,) * 8  # a round at K = 0's (Evidence.add's)


class _Chosen(NamedTuple):
    """What choose() chose for the round about to run beyond K: trees, and probes for observe()."""
    probes: dict[str, bool]  # req_id -> greedy, of the unseeded probes
    seeded_probes: set[str]
    follow_ups: set[str]  # the unseeded probes of the round before, drafting 2 tokens
    sides: dict[str, int]  # req_id -> its tree's side depth m (absent: a chain)


class SpeculationPolicy:
    def __init__(self, costs: RoundCosts, reference_draft_cost: float, branches: int = 1, side_depth: int = 0):
        """branches, side_depth: the widest token tree a request may draft (scheduler.tree_branches,
        tree_side_depth): a chain, or `branches` root children, the others m <= side_depth (0: K) deep."""
        self.costs, self.reference_draft_cost = costs, reference_draft_cost  # (draft / target step: seeded)
        self.branches, self.side_depth = branches, side_depth
        self._own: dict[str, Evidence] = {}
        self._pool = {True: Evidence(), False: Evidence()}  # by greedy: evidence and probe clock
        self.prior_weights = {True: PriorWeight(), False: PriorWeight()}  # by greedy
        self._chosen = _Chosen({}, set(), set(), {})
        self._follow_ups: set[str] = set()  # last round's probes, to draft again in the next (the model above)
        self._quiet: list[str] = []  # the requests of a round that settled the next ones (settled)
        self._probe_prices = {True: 1.0, False: 1.0}  # by greedy: the last price of a probe, in rounds

    # -- estimates ------------------------------------------------------------------------------
    def estimates(self, request: PolicyRequest, prior: Estimate | None = None) -> Estimate:
        """A request's own evidence over a prior: its kind's pool's estimates (`prior` where the
        caller has them; seeded requests: the constants)."""
        if prior is None:
            prior = _initial() if request.seeded else self._kind_prior(request.greedy)
        own = self._own.get(request.req_id) or _NO_EVIDENCE
        rates = self._rates(own, prior, PRIOR_WEIGHT if request.seeded else self.prior_weights[request.greedy].weight)
        return rates if own.missed else rates._replace(first=rates.alpha)  # (the first's own rate: after a miss)

    @staticmethod
    def _rates(evidence: Evidence, prior: Estimate, weight: float) -> Estimate:
        """The rates of `evidence` over `prior` of `weight`; an unmeasured first is no better than alpha."""
        alpha = evidence.alpha.rate(prior.alpha, weight)
        return Estimate(alpha, evidence.coverage.rate(prior.coverage, PRIOR_WEIGHT, most=1.0),
                        evidence.first.rate(min(prior.first, alpha), weight), evidence.side.rate(prior.side, weight))

    def _kind_prior(self, greedy: bool) -> Estimate:
        return self._rates(self._pool[greedy], _initial(), PRIOR_WEIGHT)

    def export(self, req_id: str) -> Evidence | None:  # (a request's own history, for another replica)
        return self._own.get(req_id)

    def adopt(self, req_id: str, evidence: Evidence) -> None:
        self._own[req_id] = evidence

    def forget(self, req_id: str) -> None:
        self._own.pop(req_id, None)

    # -- the choice -----------------------------------------------------------------------------
    def settled(self, req_ids: list[str]) -> bool:
        """Whether the last choice settled this round too (K = 0 for all, no probe): skip choose(). So while the
        same requests (caps only shrink), none seeded, no probe due or to follow, no cost fit unsolved for COST_MEMORY
        / 2 rounds (at each fit's solve, every 8, a spell chose again every ~4 rounds: ~1% of a run at batch 1)."""
        return (bool(self._quiet) and req_ids == self._quiet and not self._follow_ups
                and not self.costs.solve_due(int(COST_MEMORY) // 2)
                and not any(pool.probe_due(self._probe_prices[greedy]) for greedy, pool in self._pool.items()))

    def choose(self, requests: list[PolicyRequest]) -> list[int]:
        self._chosen = chosen = _Chosen({}, set(), set(), {})
        if self.settled([r.req_id for r in requests]):  # (never with a follow-up pending)
            return [0] * len(requests)
        follow_ups, self._follow_ups, self._quiet = self._follow_ups, set(), []
        ks = dict.fromkeys((r.req_id for r in requests), 0)
        free = [r for r in requests if r.cap > 0 and not r.seeded]
        if free:
            costs = self.costs.coefficients()
            sampled = not all(r.greedy for r in requests)  # (then the accept test runs on every row)
            prior = {greedy: self._kind_prior(greedy) for greedy in {r.greedy for r in free}}
            estimates = [self.estimates(r, prior[r.greedy]) for r in free]
            if self.costs.rounds_seen < 1 or not self._cannot_pay(free, estimates, len(requests), costs, sampled):
                for req_id, (k, side) in self._merit(free, estimates, len(requests), costs, sampled).items():
                    ks[req_id], chosen.sides[req_id] = k, side
            if len(free) == len(requests) and not any(ks.values()):
                # At K = 0 an estimate only moves towards its prior: if nothing could pay at its ceiling either
                # (the bound, else the choice), the next rounds settle too (not with seeded or capped-out requests).
                ceilings = [e.ceiling(prior[r.greedy]) for r, e in zip(free, estimates)]
                if (self._cannot_pay(free, ceilings, len(requests), costs, sampled)
                        or not any(k for k, _ in self._merit(free, ceilings, len(requests), costs, sampled).values())):
                    self._quiet = [r.req_id for r in requests]
            for r in (r for r in free if r.req_id in follow_ups and not ks[r.req_id]):
                ks[r.req_id], self._quiet = min(r.cap, 2), []
                chosen.follow_ups.add(r.req_id)
            for greedy, pool in self._pool.items():
                kind = [r for r in free if r.greedy == greedy]
                price = float("inf")  # (no probe of this kind now)
                if kind and not any(ks[r.req_id] for r in kind) and self._worth_probing(costs):
                    probe = max(kind, key=lambda r: ((self._own.get(r.req_id) or _NO_EVIDENCE).rounds_at_zero,
                                                     -r.backlog))
                    price = self._probe_rounds(probe, len(requests), costs, sampled)  # (grows with the backlog)
                    if pool.probe_due(price):
                        ks[probe.req_id], chosen.probes[probe.req_id] = 1, greedy
                        self._quiet = []  # (its result moves the estimates)
                self._probe_prices[greedy] = price
        for r in requests:
            if r.seeded and r.cap > 0:
                ks[r.req_id] = self._seeded_choice(self.estimates(r), r.cap)
                if ks[r.req_id] == 0 and (self._own.get(r.req_id) or _NO_EVIDENCE).probe_due():
                    ks[r.req_id] = 1
                    chosen.seeded_probes.add(r.req_id)
                chosen.sides[r.req_id] = side_branch_depth(ks[r.req_id], self.side_depth) * (self.branches > 1)
        return [ks[r.req_id] for r in requests]

    def tree_shape(self, req_id: str) -> tuple[int, int]:
        """(branches, side depth) of the draft choose() chose for `req_id` this round: (1, 0), a chain."""
        return (self.branches, side) if (side := self._chosen.sides.get(req_id, 0)) else (1, 0)

    def _merit(self, free: list[PolicyRequest], estimates: list[Estimate], batch: int,
               costs: tuple[float, ...], sampled: bool) -> dict[str, tuple[int, int]]:
        """(K, m) of the `free` requests (their estimates): the best prefix in expected tokens per second of a round
        of `batch` requests (the others at K = 0; `sampled`: a longer longest proposal adds positions to each row), or
        of its chains alone where a round with trees costs R more (once); m, a tree's side depth (0: a chain)."""
        if self.costs.rounds_seen < 1:  # nothing measured yet: draft, and measure it
            return {r.req_id: (min(r.cap, 1), 0) for r in free}
        v0, v1, v2, d0, d1, d2, d3, overhead, tree = costs
        plain, others, n = v0 + v1 * batch + overhead, self.branches - 1, len(free)
        items = sorted(self._items(free, estimates), key=lambda item: -item[0])
        best_rate, best = batch / max(plain, 1e-9), ([0] * n, [0] * n)
        for order in (items, [i for i in items if not i[3]]) if tree and any(i[3] for i in items) else [items]:
            ks, sides, nodes, charged = [0] * n, [0] * n, [0] * n, [0.0] * n
            # The round's seconds: plain, the rest of a draft call, steps (the largest K), the longest proposal.
            tokens, verify, draft_tokens, steps, longest, tree_price = float(batch), plain, d0, 0, 0, tree
            for _, i, worth, side in order:
                added = others if side else 1  # nodes: the tree's other children at the next side depth, or a token
                tokens, nodes[i] = tokens + worth, nodes[i] + added
                verify, draft_tokens = verify + estimates[i].coverage * v1 * added, draft_tokens + d2 * added
                if nodes[i] > longest:  # a longer longest proposal: positions more on each row of a sampled batch
                    verify, longest = verify + v2 * batch * (nodes[i] - longest + (longest == 0)) * sampled, nodes[i]
                if side:
                    sides[i], verify, tree_price = sides[i] + 1, verify + tree_price, 0.0
                else:
                    ks[i], steps = ks[i] + 1, max(steps, ks[i] + 1)
                    share = d3 * free[i].backlog * min(1.0, estimates[i].expected_tokens(ks[i]) / free[i].remaining)
                    draft_tokens, charged[i] = draft_tokens + share - charged[i], share
                rate = tokens / max(verify + draft_tokens + d1 * steps, 1e-9)
                if rate > best_rate:
                    best_rate, best = rate, (list(ks), list(sides))
        return {r.req_id: shape for r, shape in zip(free, zip(*best))}

    def _items(self, free: list[PolicyRequest], estimates: list[Estimate]):
        """(key, request, worth, side) of each token a request may ask and of a tree's other children
        a depth (b - 1 nodes), keyed by worth a node, never above that depth's token (a sort keeps ties)."""
        others = self.branches - 1
        for i, (r, e) in enumerate(zip(free, estimates)):
            sides, wide = (side_branch_depth(r.cap, self.side_depth), e.others) if others else (0, e)
            for k in range(1, r.cap + 1):
                yield (worth := e.worth(k)), i, worth, False
                if k <= sides:
                    yield min((side := wide.worth(k)) / others, worth), i, side, True

    def _cannot_pay(self, free: list[PolicyRequest], estimates: list[Estimate], batch: int,
                    costs: tuple[float, ...], sampled: bool) -> bool:
        """A bound that settles most rounds where nothing pays, cheaper than _merit: m nodes are worth at
        most min(m * the best worth a node, all worths) and cost at least a draft call (d0 + d1 + the least
        catch-up, + the accept test on 2 positions a row if sampled) + m * the least a node costs."""
        v0, v1, v2, d0, d1, d2, d3, overhead, _ = costs
        plain, others = v0 + v1 * batch + overhead, self.branches - 1
        top, worths, least_coverage, most = 0.0, 0.0, 1.0, 0
        for r, e in zip(free, estimates):
            sides = side_branch_depth(r.cap, self.side_depth) if others else 0
            top = max(top, e.worth(1), e.others.worth(1) / others if sides else 0.0)
            least_coverage, most = min(least_coverage, e.coverage), most + r.cap + others * sides
            worths += e.worth_up_to(r.cap) + (e.others.worth_up_to(sides) if sides else 0.0)
        least = v1 * least_coverage + d2
        call = d0 + d1 + d3 * min(r.backlog / r.remaining for r in free) + 2 * v2 * batch * sampled  # (least share)
        return all((batch + min(m * top, worths)) * plain <= batch * (plain + call + m * least)
                   for m in (1, most, max(1.0, worths / max(top, 1e-9))))  # (the ratio peaks at an end or the kink)

    def _probe_rounds(self, request: PolicyRequest, batch: int, costs: tuple[float, ...], sampled: bool) -> float:
        """What drafting 1 token for `request` adds to a round (its catch-up and one step, a verified
        token, the accept test on 2 positions a row if sampled), in plain rounds of this batch, >= 1."""
        v0, v1, v2, d0, d1, d2, d3, overhead, _ = costs
        price = v1 + d2 + (2 * v2 * batch if sampled else 0.0) + d0 + d1 + d3 * request.backlog
        return max(1.0, price / max(v0 + v1 * batch + overhead, 1e-9))

    def _worth_probing(self, costs: tuple[float, ...]) -> bool:
        """Could drafting pay at all: at acceptance 1, does some K of a chain beat plain decoding (one request)?
        Yes while drafting is unmeasured (draft costs fade in rounds without drafting)."""
        v0, _, _, d0, d1, d2, _, overhead, _ = costs  # (K = 4 where any K up to 4 does: K + 1 tokens, K steps, a call)
        return self.costs.rounds_seen < 1 or self.costs.draft.rounds < 1 or 4 * (v0 + overhead - d1 - d2) > d0

    def _seeded_choice(self, e: Estimate, cap: int) -> int:
        """K of a seeded request, its tree (if set) as set (its draws must not depend on the pool's)."""
        step, tree = self.reference_draft_cost + REFERENCE_VERIFY_TOKEN_COST, self.branches > 1
        return max(range(cap + 1), key=lambda k: (e.expected_tokens(k, side_branch_depth(k, self.side_depth) * tree)
                                                  / (1.0 + tree_size(k, self.branches, self.side_depth) * step), k))

    # -- learning -------------------------------------------------------------------------------
    def observe(self, report: RoundReport, greedy: dict[str, bool]) -> None:
        """Fold a round that ran, and this call's own time, into the estimates and costs (greedy: req_id -> greedy)."""
        start, chosen, drafted = perf_counter(), self._chosen, {True: False, False: False}
        pooled = {True: [0] * 8, False: [0] * 8}  # by kind: Evidence.add's counts, as `counts` below
        priors: dict[bool, Estimate] = {}  # by kind, as the round found it (computed when needed)
        for update in report.updates:
            req_id, asked = update.req_id, update.num_speculative_tokens
            if update.error is not None:
                self._own.pop(req_id, None)
                continue
            own = self._own.get(req_id) or self._own.setdefault(req_id, Evidence())
            if update.finished:
                del self._own[req_id]  # (its last round still counts for its kind)
            if not asked:  # (the common round at K = 0: only fading)
                own.add(_NO_COUNTS)
                own.rounds_at_zero, own.missed = own.rounds_at_zero + 1, False
                continue
            # The first rejected token was tested; tokens asked for but never proposed were not. A tree's
            # first branch counts as the chain it is (its first child tried first), the others apart.
            accepted, proposed, first = update.accepted * (not update.side_kept), update.proposed, own.missed
            first_accepted, first_tested = min(accepted, 1) * first, min(proposed, 1) * first
            counts = (accepted - first_accepted, accepted + (accepted < proposed) - first_tested, first_accepted,
                      first_tested, update.side_kept, update.side_tried, proposed, asked)
            kind = greedy.get(req_id, True)
            if counts[1]:  # tokens of alpha: they choose the kind's prior weight
                prior = priors.get(kind) or priors.setdefault(kind, self._kind_prior(kind))
                self.prior_weights[kind].score(own, counts[0], counts[1], prior.alpha)
            own.add(counts)
            own.missed = accepted < proposed
            pooled[kind] = [total + n for total, n in zip(pooled[kind], counts)]
            if req_id in chosen.seeded_probes:
                own.probed(brought_back=False)
            elif req_id in chosen.probes or req_id in chosen.follow_ups:
                own.rounds_at_zero = 0  # (the kind's clock, not its own, paces its probes)
                if req_id in chosen.probes and accepted and not update.finished:
                    self._follow_ups.add(req_id)
            else:
                drafted[kind] = True
                own.probed(brought_back=True)
        for kind, pool in self._pool.items():
            counts = pooled[kind]  # (as Evidence.add's)
            if counts[7]:  # fading by DECAY per w tokens tested (by PRIOR_WEIGHT asked): a memory of ~10 w
                pool.add(counts, fade=DECAY ** ((counts[1] + counts[3]) / self.prior_weights[kind].weight),
                         coverage_fade=DECAY ** (counts[7] / PRIOR_WEIGHT))
            if drafted[kind] or kind in chosen.probes.values():
                pool.probed(brought_back=drafted[kind])
            else:
                pool.rounds_at_zero += 1
        self.costs.observe(report_shape(report, greedy), report.verify_seconds, report.draft_seconds,
                           report.overhead_seconds + perf_counter() - start, prefill=report.target_prefill > 0)
        self._chosen = _Chosen({}, set(), set(), {})


def report_shape(report: RoundReport, greedy: dict[str, bool]) -> RoundShape:
    """What a round that ran fed the target and asked of the drafter (RoundCosts' features)."""
    fed = verified = longest = sampling = tree = 0
    for u in (u for u in report.updates if u.error is None):
        scored = u.proposed if u.tree_nodes is None else u.tree_nodes
        fed, verified, longest = fed + scored + 1, verified + 1, max(longest, scored)
        sampling, tree = sampling or not greedy.get(u.req_id, True), tree or u.tree_nodes is not None
    sampled = verified * (longest + 1) if sampling and longest else 0
    return RoundShape(fed, sampled, report.draft_steps, report.draft_proposed, report.draft_catch_up, int(tree))
