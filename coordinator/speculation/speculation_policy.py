"""How many tokens each running request drafts this round: K from 0 (plain decoding) to its cap.

The model:
- alpha: a request's acceptance per draft token. A round drafting K commits on average
  E(alpha, K) = 1 + alpha + ... + alpha^K tokens, so its k-th draft token is worth alpha^k.
- A request's alpha = (accepted + PRIOR_WEIGHT * prior) / (tested + PRIOR_WEIGHT), tested = the
  accepted draft tokens plus the first rejected or missing one (asked for but not proposed, as by
  an n-gram lookup that found nothing), both counts fading by DECAY every round the
  request takes part in (at K = 0 too: old evidence gives way to the prior). The prior is the
  pool: the same estimate over every request of the same kind (greedy or sampled), fading by
  DECAY per PRIOR_WEIGHT tokens tested, starting at INITIAL_ACCEPTANCE; a new request starts
  from it.
- A round's seconds for given K's: RoundCosts, learnt online from the rounds that ran.
- The choice maximises committed tokens per second, sum E(alpha_i, K_i) / seconds: draft tokens
  are added in decreasing order of worth and the best prefix wins, i.e. a common threshold on
  worth (each kept token is worth at least what it costs; draft steps are shared by the batch).
- Probes keep K = 0 from being a trap: a kind's requests at K = 0 gain no evidence, so once a
  kind has had no drafting round for its probe interval, one request of that kind drafts 1 token:
  the one that has gone longest without drafting (the smaller backlog among equals). Its result
  moves its own estimate and the pool's. The interval starts at 2 rounds and doubles, up to
  MAX_PROBE_INTERVAL, after each probe that brings no request back, and resets when one drafts on
  merit; it counts in rounds' worth of the probe's predicted price (a draft call catching up the
  request's backlog, a step, one more verified token) where that exceeds a plain round, so a dear
  probe (a draft as large as the target) costs no more of the time than a cheap one. No probe
  where even acceptance 1 could not pay for drafting (while that price is measured: it fades
  with rounds that do not draft).
- Seeded sampled requests: which draws decide a token depends on K, so their K must follow their
  own history only. Each maximises its own E / reference cost, 1 + K (c + REFERENCE_VERIFY_TOKEN_COST)
  in target steps, c = draft/target parameter ratio, from the constant prior INITIAL_ACCEPTANCE,
  and probes on its own clock of rounds; never the pool, the batch, or a timing.
choose() changes no state (a round that then fails leaves the policy as it was); observe()
records what the round that ran did.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.rounds.round_report import RoundReport
from coordinator.speculation.round_costs import RoundCosts, RoundShape

PRIOR_WEIGHT = 4.0  # tested tokens the prior counts for: one unlucky round must not end speculation
DECAY = 0.9  # a request's evidence per round: acceptance shifts within a request (code, then prose)
INITIAL_ACCEPTANCE = 0.6  # the pool's prior before any evidence, and seeded requests' prior
MAX_PROBE_INTERVAL = 64  # rounds: probing a drafter that never pays costs about 1 round in this many
REFERENCE_VERIFY_TOKEN_COST = 0.1  # one more verified token, in target steps (seeded requests' rule)
_ALPHA_MAX = 0.999  # keeps E finite


def expected_tokens(alpha: float, k: int) -> float:
    """E(alpha, K) = (1 - alpha^(K+1)) / (1 - alpha) for alpha < 1."""
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class PolicyRequest:
    req_id: str
    cap: int  # the most this request may draft this round (its max, near-end and context limits)
    greedy: bool
    seeded: bool  # a seeded sampled request: K from its own history only
    backlog: int = 0  # committed tokens the drafter has not seen beyond one round's worth


@dataclass
class Evidence:
    """Accepted and tested draft tokens, faded; a probe clock (rounds at 0, the current interval)."""

    accepted: float = 0.0
    tested: float = 0.0
    rounds_at_zero: int = 0
    interval: int = 2

    def alpha(self, prior: float) -> float:
        rate = (self.accepted + PRIOR_WEIGHT * prior) / (self.tested + PRIOR_WEIGHT)
        return min(max(rate, 0.0), _ALPHA_MAX)

    def add(self, accepted: float, tested: float, fade: float | None = None) -> None:
        fade = DECAY if fade is None else fade
        self.accepted = fade * self.accepted + accepted
        self.tested = fade * self.tested + tested

    def probed(self, brought_back: bool) -> None:
        self.rounds_at_zero = 0
        self.interval = 2 if brought_back else min(2 * self.interval, MAX_PROBE_INTERVAL)

    def probe_due(self, price_in_rounds: float = 1.0) -> bool:
        return self.rounds_at_zero + 1 >= self.interval * price_in_rounds


@dataclass
class _Chosen:
    """What choose() decided for the round about to run, for observe() to record."""

    ks: dict[str, int] = field(default_factory=dict)
    probes: dict[str, bool] = field(default_factory=dict)  # req_id -> greedy, of the unseeded probes
    seeded_probes: set[str] = field(default_factory=set)


class SpeculationPolicy:
    def __init__(self, costs: RoundCosts, reference_draft_cost: float):
        self.costs = costs
        self.reference_draft_cost = reference_draft_cost  # draft step / target step (seeded requests)
        self._own: dict[str, Evidence] = {}
        self._pool = {True: Evidence(), False: Evidence()}  # by greedy: evidence and probe clock
        self._chosen = _Chosen()

    # -- estimates ------------------------------------------------------------------------------
    def alpha(self, request: PolicyRequest) -> float:
        own = self._own.get(request.req_id) or Evidence()
        if request.seeded:
            return own.alpha(INITIAL_ACCEPTANCE)
        return own.alpha(self._pool[request.greedy].alpha(INITIAL_ACCEPTANCE))

    def export(self, req_id: str) -> Evidence | None:
        """A request's own history, to carry to another replica's policy (`adopt`)."""
        return self._own.get(req_id)

    def adopt(self, req_id: str, evidence: Evidence) -> None:
        self._own[req_id] = evidence

    def forget(self, req_id: str) -> None:
        self._own.pop(req_id, None)

    # -- the choice -----------------------------------------------------------------------------
    def choose(self, requests: list[PolicyRequest]) -> list[int]:
        self._chosen = chosen = _Chosen()
        free = [r for r in requests if not r.seeded and r.cap > 0]
        ks = dict.fromkeys((r.req_id for r in requests), 0)
        ks.update(self._merit(free, [self.alpha(r) for r in free], requests))
        for greedy in (True, False):
            kind = [r for r in free if r.greedy == greedy]
            pool = self._pool[greedy]
            # Cheapest tests first: a round at K = 0 mostly ends at the interval (a price is >= 1).
            if kind and not any(ks[r.req_id] for r in kind) and pool.probe_due() and self._worth_probing():
                probe = max(kind, key=lambda r: (self._rounds_at_zero(r), -r.backlog))
                if pool.probe_due(self._probe_rounds(probe, len(requests))):
                    ks[probe.req_id], chosen.probes[probe.req_id] = 1, greedy
        for r in requests:
            if r.seeded and r.cap > 0:
                evidence = self._own.get(r.req_id) or Evidence()
                ks[r.req_id] = self._seeded_choice(evidence.alpha(INITIAL_ACCEPTANCE), r.cap)
                if ks[r.req_id] == 0 and evidence.probe_due():
                    ks[r.req_id] = 1
                    chosen.seeded_probes.add(r.req_id)
        chosen.ks = ks
        return [ks[r.req_id] for r in requests]

    def _merit(self, free: list[PolicyRequest], alphas: list[float], batch: list[PolicyRequest]) -> dict[str, int]:
        """K of the `free` requests maximising expected tokens per second (the others in `batch`
        run plain or by their own rule: priced at K = 0)."""
        if not free:
            return {}
        if self.costs.rounds_seen < 1:  # nothing measured yet: draft, and measure it
            return {r.req_id: min(r.cap, 1) for r in free}
        v0, v1, v2, d0, d1, d2, d3, overhead = self.costs.coefficients()
        order = sorted(((a ** k, i) for i, (r, a) in enumerate(zip(free, alphas)) for k in range(1, r.cap + 1)),
                       key=lambda pair: -pair[0])
        ks = [0] * len(free)
        tokens = float(len(batch))
        plain = v0 + v1 * len(batch) + overhead
        verify, steps, draft_tokens = plain, 0, d0  # the round's seconds: plain, steps, the rest of a draft call
        best_rate, best = tokens / max(plain, 1e-9), list(ks)
        for worth, i in order:
            request = free[i]
            ks[i] += 1
            tokens += worth
            verify += v1 + (v2 * (2 if ks[i] == 1 else 1) if not request.greedy else 0.0)
            draft_tokens += d2 + (d3 * request.backlog if ks[i] == 1 else 0.0)
            steps = max(steps, ks[i])
            rate = tokens / max(verify + draft_tokens + d1 * steps, 1e-9)
            if rate > best_rate:
                best_rate, best = rate, list(ks)
        return {r.req_id: k for r, k in zip(free, best)}

    def _rounds_at_zero(self, request: PolicyRequest) -> int:
        own = self._own.get(request.req_id)
        return own.rounds_at_zero if own is not None else 0

    def _probe_rounds(self, request: PolicyRequest, batch: int) -> float:
        """What drafting 1 token for `request` adds to a round (a draft call that catches up its
        backlog and takes one step, one more verified token), in plain rounds of this batch; at
        least 1 (0-priced where unmeasured: try it)."""
        v0, v1, v2, d0, d1, d2, d3, overhead = self.costs.coefficients()
        price = v1 + (0.0 if request.greedy else 2 * v2) + d0 + d1 + d2 + d3 * request.backlog
        return max(1.0, price / max(v0 + v1 * batch + overhead, 1e-9))

    def _worth_probing(self) -> bool:
        """Could drafting pay at all: at acceptance 1, does some K beat plain decoding (one request)?
        Yes while drafting is unmeasured: draft costs fade as rounds go by without drafting, so a
        price measured on a bad spell of the machine is measured again."""
        if self.costs.rounds_seen < 1 or self.costs.draft.rounds < 1:
            return True
        plain = self.costs.round_seconds(RoundShape(1, 0, 0, 0, 0))
        return any((k + 1) / self.costs.round_seconds(RoundShape(k + 1, 0, k, k, 0)) > 1 / plain for k in (1, 2, 4))

    def _seeded_choice(self, alpha: float, cap: int) -> int:
        step = self.reference_draft_cost + REFERENCE_VERIFY_TOKEN_COST
        return max(range(cap + 1), key=lambda k: (expected_tokens(alpha, k) / (1.0 + k * step), k))

    # -- learning -------------------------------------------------------------------------------
    def observe(self, report: RoundReport, greedy: dict[str, bool]) -> None:
        """Fold a round that ran into the estimates and the costs (`greedy`: req_id -> greedy)."""
        chosen, drafted = self._chosen, {True: False, False: False}
        pooled = {True: [0.0, 0.0], False: [0.0, 0.0]}  # accepted, tested this round, by kind
        for update in report.updates:
            if update.error is not None:
                self._own.pop(update.req_id, None)
                continue
            own = self._own.setdefault(update.req_id, Evidence())
            # Per token asked: a drafter that proposed fewer (an n-gram lookup that found nothing)
            # missed there, as a rejected token would have.
            tested = update.accepted + (1 if update.accepted < update.num_speculative_tokens else 0)
            own.add(update.accepted, tested)
            kind = greedy.get(update.req_id, True)
            pooled[kind][0] += update.accepted
            pooled[kind][1] += tested
            if update.req_id in chosen.seeded_probes:
                own.probed(brought_back=False)
            elif update.req_id in chosen.probes:
                own.rounds_at_zero = 0  # (the kind's clock, not its own, paces its probes)
            elif update.num_speculative_tokens > 0:
                drafted[kind] = True
                own.probed(brought_back=True)
            else:
                own.rounds_at_zero += 1
            if update.finished:
                self._own.pop(update.req_id, None)
        for kind, pool in self._pool.items():
            if pooled[kind][1]:  # fading by DECAY per PRIOR_WEIGHT tokens tested: a memory of ~40
                pool.add(*pooled[kind], fade=DECAY ** (pooled[kind][1] / PRIOR_WEIGHT))
            if drafted[kind]:
                pool.probed(brought_back=True)
            elif kind in chosen.probes.values():
                pool.probed(brought_back=False)
            else:
                pool.rounds_at_zero += 1
        self.costs.observe(report_shape(report, greedy), report.verify_seconds, report.draft_seconds,
                           report.overhead_seconds, prefill=report.target_prefill > 0)
        self._chosen = _Chosen()


def report_shape(report: RoundReport, greedy: dict[str, bool]) -> RoundShape:
    """What a round that ran fed the target and asked of the drafter (RoundCosts' features)."""
    verified = [u for u in report.updates if u.error is None]
    return RoundShape(fed=sum(u.proposed + 1 for u in verified),
                      sampled=sum(u.proposed + 1 for u in verified if u.proposed and not greedy.get(u.req_id, True)),
                      steps=report.draft_steps, proposed=report.draft_proposed, catch_up=report.draft_catch_up)
