"""What a round costs here, learnt online from the rounds the scheduler runs (no start-up timing).

Terms, per round (RoundReport): the target is fed T tokens (each verified request its draft's
nodes + 1); where a request samples and something was proposed, the accept test takes
distributions at P = B (longest draft + 1) positions, else P = 0; the drafter, when called, runs
S = max K steps drafting D nodes after catching up on C committed tokens it had not seen (a new
prompt, rounds at K = 0); R = 1 where a request drafts a token tree (a GPU runs those passes
eagerly: 5-11x a graphed one); the coordinator's own time is the rest, with the policy's observe.

Model: verify seconds = v0 + v1 T + v2 P + v3 R; draft seconds = d0 + d1 S + d2 D + d3 C + d4 R (0
when not called); coordinator seconds = o0 + o1 if the drafter is called (proposals, accept results
and estimates to handle: 0.1-0.15 ms at batch 4, 8% of a plain round there; priced in d0). Each is a
least-squares fit over past rounds with no term below 0 (noise, never a saving), a round's weight
fading by 1 - 1 / COST_MEMORY per later round, so the costs follow the machine (load, context
growth) within tens of rounds; a round counts at most twice its prediction or the mean round, the
larger (an unmeasured term prices a shape at ~0): on a shared CPU one round in fifty stalls for
10-100x its time, and unclipped, such spikes set the slopes. Terms the rounds seen so far cannot
tell apart (every round alike) are pulled towards 0 but one per fit, which takes their cost: the
pass's (v0), the draft step's (d1), the drafting round's (o1). That is the optimistic guess: more
verified tokens look free, a shorter K and K = 0 cheaper, so the policy tries and measures them (a
draft call's constant taking the cost, a K shorter than the one measured was priced as dear and
never tried). A round that fed the target a prompt is left out of the verify fit, and so is the
next: it runs cold (a pass 1.7-2.4x slower; counted, it priced a verified token at 5x after K = 0).
"""
from __future__ import annotations

from typing import NamedTuple

# Rounds over which a round's timing fades to 1/e of its weight: long enough to average single rounds'
# noise (a shared CPU's timings jump by 2x), short enough to follow a load that changes within a request.
COST_MEMORY = 50.0
_RIDGE = 1e-6  # pull of an unmeasured term towards 0, in (normalised) rounds: only breaks ties
_SOLVE_EVERY = 8  # rounds between solves once a fit has seen as many: a round moves it by ~2% (1 / COST_MEMORY)


class RoundShape(NamedTuple):
    """The features of a round that its cost depends on (module docstring)."""
    fed: int  # T
    sampled: int  # P
    steps: int  # S (0: no draft call)
    proposed: int  # D
    catch_up: int  # C
    tree: int = 0  # R


class FadingLeastSquares:
    """theta >= 0 minimising sum over rounds r of fade^(age r) (y_r - x_r . theta)^2 + ridge |theta|^2 but
    theta[free] (never pulled), on features x (the first the constant 1) divided by `scales` (so one
    ridge suits all). Consecutive rounds of the same features (a steady batch at K = 0) gather as one
    weighted round till they change or theta is read; theta is solved when read after each of the
    first _SOLVE_EVERY rounds, then every _SOLVE_EVERY."""

    def __init__(self, scales: list[float], free: int = 0):
        self.scales, self.free, size = scales, free, len(scales)
        self.fade = 1.0 - 1.0 / COST_MEMORY
        self.gram, self.moment = [[0.0] * size for _ in range(size)], [0.0] * size
        self.rounds = 0.0  # the faded count of rounds seen
        self._theta, self._per_unit = [0.0] * size, [0.0] * size
        self._unsolved, self._added, self._idle = 0, 0, 0  # rounds added since a solve, in all; unobserved since
        # The run of rounds with the same features not yet in gram and moment: their features (unscaled,
        # scaled), count, faded weight and sum of seconds, and the most a round counts (spikes: module docstring).
        self._run, self._run_x, self._run_cap = (), [], float("inf")
        self._run_rounds, self._run_weight, self._run_seconds = 0, 0.0, 0.0

    def solve_due(self, every: int = _SOLVE_EVERY) -> bool:
        return bool(self._unsolved) and (self._unsolved >= every or self._added <= _SOLVE_EVERY)

    def per_unit(self, solve: bool = True) -> list[float]:
        """theta in seconds per unit of each (unscaled) feature, none below 0 (a measured slope below 0 is
        noise, never a saving); solve=False: as last solved."""
        if solve and self.solve_due():
            self._unsolved = 0
            self._flush()
            self._theta = _solve(self.gram, self.moment, _RIDGE, self.free)
            self._per_unit = [t / s for t, s in zip(self._theta, self.scales)]
            self._set_cap()
        return self._per_unit

    def add(self, x: tuple[float, ...], y: float) -> None:
        """A round of features x (unscaled) that took y seconds."""
        if self._idle:  # (the rounds without an observation since the last one: see fade_out)
            decay, self._idle = self.fade ** self._idle, 0
            self.gram = [[decay * g for g in row] for row in self.gram]
            self.moment = [decay * m for m in self.moment]
        if x != self._run:
            self._flush()
            self._run, self._run_x = x, [v / s for v, s in zip(x, self.scales)]
            self._set_cap()
        fade = self.fade
        self._run_rounds += 1
        self._run_weight = fade * self._run_weight + 1.0
        self._run_seconds = fade * self._run_seconds + min(y, self._run_cap)
        self.rounds = fade * self.rounds + 1.0
        self._unsolved, self._added = self._unsolved + 1, self._added + 1

    def _flush(self) -> None:
        """The run into gram and moment: m rounds of features x add sum_r fade^(m-r) x x^T."""
        if not self._run_rounds:
            return
        decay, x, weight, seconds = self.fade ** self._run_rounds, self._run_x, self._run_weight, self._run_seconds
        self.gram = [[decay * g + weight * xi * xj for g, xj in zip(row, x)] for row, xi in zip(self.gram, x)]
        self.moment = [decay * m + seconds * xi for m, xi in zip(self.moment, x)]
        self._run_rounds, self._run_weight, self._run_seconds = 0, 0.0, 0.0

    def _set_cap(self) -> None:
        if self._added > self._unsolved and self._run_x:  # (_theta from a solve, not the zeros it starts as)
            mean = self.moment[0] / max(self.gram[0][0], 1e-12)  # (the module docstring)
            self._run_cap = 2.0 * max(sum(t * v for t, v in zip(self._theta, self._run_x)), mean, 1e-6)

    def fade_out(self) -> None:
        """A round without an observation: the rounds seen fade as at any round (at the next add), so new
        rounds outweigh an old spell, and a fit no round exercises (no draft calls) comes to count as unmeasured."""
        self._flush()  # (a run after this starts afresh, so that the idle rounds age it too)
        self._idle += 1
        self.rounds *= self.fade


def _solve(gram: list[list[float]], moment: list[float], ridge: float, free: int) -> list[float]:
    """(gram + ridge on the diagonal but its entry `free`) x = moment by Gauss-Jordan (numpy ran cold at ~0.5 ms
    a solve), x >= 0: the most negative term is held at 0 and the rest solved again till none is below 0 (one
    clipped after the solve left the term it traded against too large); no data (a zero pivot): 0."""
    n, held = len(moment), set()
    while True:
        m = [[float(i == j) for j in range(n + 1)] if i in held  # (held: x_i = 0)
             else row[:i] + [row[i] + (ridge if i != free else 0.0)] + row[i + 1:] + [b]
             for i, (row, b) in enumerate(zip(gram, moment))]
        for col in range(n):
            pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
            m[col], m[pivot] = m[pivot], m[col]
            if abs(m[col][col]) >= 1e-12:
                m[col] = [v / m[col][col] for v in m[col]]
                for r, f in [(r, row[col]) for r, row in enumerate(m) if r != col and row[col]]:
                    m[r] = [v - f * w for v, w in zip(m[r], m[col])]
        theta = [0.0 if i in held or abs(m[i][i]) < 1e-12 else m[i][n] for i in range(n)]  # (held: exactly 0)
        least = min(range(n), key=theta.__getitem__)
        if not theta[least] < 0.0:
            return theta
        held.add(least)


class RoundCosts:
    """Predicted seconds of a round of a given shape; `observe` learns from each round that ran.
    `max_fed` and `max_steps` (the largest batch's tokens and the largest K) scale the features."""

    def __init__(self, max_fed: int, max_steps: int):
        fed, steps = float(max(max_fed, 1)), float(max(max_steps, 1))
        self.verify = FadingLeastSquares([1.0, fed, fed, 1.0])  # 1, T, P, R
        self.draft = FadingLeastSquares([1.0, steps, fed, 8.0 * fed, 1.0], free=1)  # 1, S, D, C, R
        self.overhead = FadingLeastSquares([1.0, 1.0], free=1)  # 1, called
        self._cold = False  # the next round follows a prompt's pass (module docstring)

    @property
    def rounds_seen(self) -> float:
        return self.verify.rounds

    def round_seconds(self, shape: RoundShape, solve: bool = True) -> float:
        """Predicted seconds of a round of this shape (solve=False: by the fits as last solved, so
        that a caller who only watches leaves the next solve where it falls)."""
        v0, v1, v2, d0, d1, d2, d3, overhead, tree = self.coefficients(solve)
        seconds = v0 + v1 * shape.fed + v2 * shape.sampled + overhead + tree * shape.tree
        if shape.steps or shape.catch_up:
            seconds += d0 + d1 * shape.steps + d2 * shape.proposed + d3 * shape.catch_up
        return seconds

    def solve_due(self, every: int = _SOLVE_EVERY) -> bool:
        """Whether coefficients() would solve a fit again, or has `every` rounds unsolved (they change little)."""
        return any(fit.solve_due(every) for fit in (self.verify, self.draft, self.overhead))

    def coefficients(self, solve: bool = True) -> tuple[float, ...]:
        """(v0, v1, v2, d0, d1, d2, d3, overhead, v3 + d4), seconds per unit of each feature, for a caller
        pricing many shapes of one round (the policy's choice); d0 with the coordinator's extra (o1)."""
        (v0, v1, v2, v3), (d0, d1, d2, d3, d4) = self.verify.per_unit(solve), self.draft.per_unit(solve)
        overhead, called = self.overhead.per_unit(solve)
        return v0, v1, v2, d0 + called, d1, d2, d3, overhead, v3 + d4

    def observe(self, shape: RoundShape, verify_seconds: float, draft_seconds: float, overhead_seconds: float,
                prefill: bool) -> None:
        """Fold in a round that ran: its shape and measured seconds (`prefill`: it fed a prompt)."""
        if not (prefill or self._cold):
            self.verify.add((1.0, shape.fed, shape.sampled, shape.tree), verify_seconds)
        self._cold = prefill
        if called := bool(shape.steps or shape.catch_up):
            self.draft.add((1.0, shape.steps, shape.proposed, shape.catch_up, shape.tree), draft_seconds)
        else:
            self.draft.fade_out()
        self.overhead.add((1.0, float(called)), overhead_seconds)
