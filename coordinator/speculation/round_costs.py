"""What a round costs here, learnt online from the rounds the scheduler runs (no start-up timing).

Terms, per round (RoundReport):
- the target is fed T tokens (each verified request its K + 1), of which P belong to sampled
  requests that drafted (their K + 1 positions need distributions and the accept test);
- the drafter, when called, runs S = max K steps proposing D = sum K tokens, after catching up on
  C committed tokens it had not seen (a new prompt, rounds at K = 0);
- the coordinator's own time is the rest of the round.

Model: verify seconds = v0 + v1 T + v2 P; draft seconds = d0 + d1 S + d2 D + d3 C (0 when not
called); overhead seconds = o. A pass streams the weights once (v0) and computes per token (v1):
on a 2-core CPU v1 is about 5% of v0 at batch 1 and 8 alike, on a GPU far less. Each is a
least-squares fit over past rounds in which a round's weight fades by 1 - 1 / COST_MEMORY per
later round, so the costs follow the machine (load, context growth) within tens of rounds; a
round is counted at most twice what the fit predicted for it (on a shared CPU one round in fifty
stalls for 10-100x its time: unclipped, such spikes set the fit's slopes).
Slopes that the rounds seen so far cannot pin down (every round alike) are pulled towards 0, the
optimistic guess: more tokens look free, so the policy tries them and measures them. A round that
fed the target a prompt says nothing about verifying and is left out of the verify fit.
"""
from __future__ import annotations

from dataclasses import dataclass

# Rounds over which a round's timing fades to 1/e of its weight: long enough to average the noise
# of single rounds (a shared CPU's timings jump by 2x), short enough to follow a machine whose
# load changes within a request's lifetime.
COST_MEMORY = 50.0
_RIDGE = 1e-6  # pull of an unmeasured slope towards 0, in (normalised) rounds: only breaks ties


@dataclass(frozen=True)
class RoundShape:
    """The features of a round that its cost depends on (module docstring)."""

    fed: int  # T
    sampled: int  # P
    steps: int  # S (0: no draft call)
    proposed: int  # D
    catch_up: int  # C


class FadingLeastSquares:
    """theta minimising sum over rounds r of fade^(age r) (y_r - x_r . theta)^2 + ridge |slopes|^2,
    on features x whose first is the constant 1 (the intercept, never pulled). Features are
    divided by `scales` first, so one ridge suits all."""

    def __init__(self, scales: list[float]):
        self.scales = scales
        size = len(scales)
        self.fade = 1.0 - 1.0 / COST_MEMORY
        self.gram = [[0.0] * size for _ in range(size)]
        self.moment = [0.0] * size
        self.theta = [0.0] * size
        self.rounds = 0.0  # the faded count of rounds seen

    def add(self, x: list[float], y: float) -> None:
        x = [v / s for v, s in zip(x, self.scales)]
        if self.gram[0][0] > 0:  # a round at most twice the prediction: spikes move it little
            y = min(y, 2.0 * max(sum(t * v for t, v in zip(self.theta, x)), 1e-6))
        fade, size = self.fade, len(x)
        for i in range(size):
            row = self.gram[i]
            for j in range(size):
                row[j] = fade * row[j] + x[i] * x[j]
            self.moment[i] = fade * self.moment[i] + x[i] * y
        self.rounds = fade * self.rounds + 1.0
        self._refit()

    def fade_out(self) -> None:
        """A round without an observation: the fit stands, but its count of rounds fades, so a fit
        that rounds no longer exercise (no draft calls) comes to count as unmeasured."""
        self.rounds *= self.fade

    def _refit(self) -> None:
        self.theta = _solve([[g + (_RIDGE if i == j and i else 0.0) for j, g in enumerate(row)]
                             for i, row in enumerate(self.gram)], self.moment)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """a x = b by Gaussian elimination with partial pivoting (a few unknowns: plain Python is
    faster than numpy's call overhead); unknowns without data (a zero pivot) are 0."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-12:
            continue
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                m[r] = [v - f * w for v, w in zip(m[r], m[col])]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        if abs(m[r][r]) >= 1e-12:
            x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


class RoundCosts:
    """Predicted seconds of a round of a given shape; `observe` learns from each round that ran.
    `max_fed` and `max_steps` (the largest batch's tokens and the largest K) scale the features."""

    def __init__(self, max_fed: int, max_steps: int):
        fed = float(max(max_fed, 1))
        steps = float(max(max_steps, 1))
        self.verify = FadingLeastSquares([1.0, fed, fed])  # 1, T, P
        self.draft = FadingLeastSquares([1.0, steps, fed, 8.0 * fed])  # 1, S, D, C
        self.overhead = 0.0
        self._overhead_weight = 0.0

    @property
    def rounds_seen(self) -> float:
        return self.verify.rounds

    def round_seconds(self, shape: RoundShape) -> float:
        """Predicted seconds of a round of this shape (coefficients below 0 count as 0: a measured
        slope is noise there, never a saving)."""
        v0, v1, v2, d0, d1, d2, d3, overhead = self.coefficients()
        seconds = v0 + v1 * shape.fed + v2 * shape.sampled + overhead
        if shape.steps or shape.catch_up:
            seconds += d0 + d1 * shape.steps + d2 * shape.proposed + d3 * shape.catch_up
        return seconds

    def coefficients(self) -> tuple[float, ...]:
        """(v0, v1, v2, d0, d1, d2, d3, overhead) in seconds per unit of each feature: for a caller
        that prices many shapes of one round (the policy's choice); a draft call's terms apply only
        where it drafts."""
        verify = [max(t, 0.0) / s for t, s in zip(self.verify.theta, self.verify.scales)]
        draft = [max(t, 0.0) / s for t, s in zip(self.draft.theta, self.draft.scales)]
        return (*verify, *draft, self.overhead)

    def observe(self, shape: RoundShape, verify_seconds: float, draft_seconds: float, overhead_seconds: float,
                prefill: bool) -> None:
        """Fold in a round that ran: its shape and measured seconds (`prefill`: it fed a prompt)."""
        if not prefill:
            self.verify.add([1.0, shape.fed, shape.sampled], verify_seconds)
        if shape.steps or shape.catch_up:
            self.draft.add([1.0, shape.steps, shape.proposed, shape.catch_up], draft_seconds)
        else:
            self.draft.fade_out()
        fade = 1.0 - 1.0 / COST_MEMORY
        if self._overhead_weight:
            overhead_seconds = min(overhead_seconds, 2.0 * max(self.overhead, 1e-6))
        self._overhead_weight = fade * self._overhead_weight + 1.0
        self.overhead += (overhead_seconds - self.overhead) / self._overhead_weight
