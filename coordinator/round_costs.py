"""What a round costs on this machine: measured at start-up through the round protocol itself,
refreshed from every RoundReport.

Terms:
- verify pass: one target call over b sequences, each fed t tokens (t = its K + 1);
  `grid_seconds(b, t)` interpolates a grid measured (greedy) over batch sizes and tokens per
  sequence, `verify_seconds(b, t, sampled)` adds the online correction and the accept test;
- ragged pass: sequences fed different numbers of tokens. Attention runs over a layout padded to
  the longest, so one sequence at K = 5 among seven at 0 costs nearly what all eight at 5 cost
  (measured: 9.4 ms against 4.8 ms for all at 0 and 12.2 ms for all at 5). It is priced as a
  uniform pass of `effective_tokens(mean, longest) = mean + ragged_share * (longest - mean)`
  tokens per sequence, ragged_share measured on one half-and-half pass at the largest batch;
- catch-up: a request back from K = 0 (or new: its prompt) first feeds the drafter every token
  it has not seen, `catch_up_token_seconds` each: timed at start-up on one draft call that feeds
  a batch of ~200-token prompts, corrected online. Fed in one pass, such tokens cost a fraction
  of a decode step's share each (about a seventh on the dev machine); the sampled draft factor,
  which prices a step's sampling, does not apply to them;
- draft step: one batched forward of the drafter over the n sequences still drafting; a draft
  call of K steps costs `draft_call_seconds + sum over steps of draft_step_seconds(n_step)`;
- overhead: the coordinator's own time per round (scheduling, stop conditions, streaming);
- sampled rounds (any request with T > 0): the grid is measured greedy. A sampled verify pass
  that carries proposals also runs the accept test (distributions at every position, the
  residual): `accept_seconds(b)`, measured at the smallest and largest batch; a sampled draft step
  costs `sampled_draft_factor` times a greedy one (top-k, q, the draw). Both are timed as paired
  differences: a greedy and a sampled round of the same shape back to back, the median over
  repeats (two cells measured minutes apart differed by up to 3 ms on this shared machine, more
  than the accept test itself). Sampled rounds are corrected online apart from greedy ones (a
  mixed load must not blur the two); one correction scales a sampled pass with its accept test,
  so the test's share stays the measured one while both follow the machine's speed. (Correcting
  the test apart, from what drafting rounds took beyond the pass's estimate, charged it with the
  pass's own error: it grew to 4x its measured time and priced K = 1 out at batch 1.)
- a plain pass (every sequence fed one token: a round at K = 0) is further multiplied by a factor
  of its own, learnt from plain rounds at a quarter of the rate: what the grid gets wrong differs
  between plain and drafting passes (its calibration noise, cell by cell; attention over a longer
  context than timed weighs more in a pass of more tokens), and with the one correction learnt
  from drafting rounds a plain round at batch 8 was priced 20% above its cost (12.4 ms against
  10.2), so the policy drafted at 0.85x plain. The machine's speed stays one shared scale: with
  a correction per kind of pass, a machine 20% slower than at calibration, seen through plain
  rounds only (batch 8, T = 0.8), left drafting rounds priced at the old speed, and the policy
  drafted at 0.88x plain.

Measuring through DraftClient / TargetClient (not the models directly) prices what the policy
actually pays, transport included, in process and over gRPC alike.
"""
from __future__ import annotations

import bisect
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from coordinator.clients import DraftClient, TargetClient
from coordinator.round_report import RoundReport
from specdec.params import SamplingParams
from specdec.round_types import DraftTask, SparseDist, VerifyTask

_REFRESH = 0.1  # weight of each new round in the online corrections
# The same for the plain-pass factors: slower, so that the machine's drift goes to the shared
# scale (it moves 80% of the way there when only plain rounds run) and a factor keeps its shape.
_FACTOR_REFRESH = 0.025
# The context per sequence (at most; growth included) that verify passes are timed at: attention's
# share grows with it, and the grid timed at 32-token prompts priced a plain pass at batch 8
# 20% above what it cost beside 200-token ones, where drafting passes came out right (one online
# correction serves both), so the policy drafted where plain rounds were the faster (0.85x).
SERVING_CONTEXT = 256
_RANDOM_Q_WIDTH = 64  # q entries of a stand-in proposal when the drafter sent none to copy


@dataclass
class RoundCosts:
    batch_sizes: list[int]  # grid of the measurements, ascending
    verify_tokens: list[int]  # tokens per sequence of the verify grid, ascending, starts at 1
    verify_grid: list[list[float]]  # seconds, [batch][tokens]
    draft_step: list[float]  # seconds of one draft step, per batch size
    draft_call_seconds: float = 0.0  # a draft call's cost beyond its steps (transport, sync)
    overhead_seconds: float = 0.0
    sampled_batches: list[int] = field(default_factory=list)  # where the sampled passes were timed
    sampled_accept_seconds: list[float] = field(default_factory=list)  # sampled verify - greedy, there
    sampled_draft_factor: float = 1.0  # a sampled draft call / a greedy one
    ragged_share: float = 0.0  # of the longest sequence's extra tokens, what a ragged pass pays for all
    catch_up_token_seconds: float | None = None  # None (not measured): a sequence's share of the largest draft step
    # Online corrections (measured / predicted), greedy and sampled rounds apart, so a loaded
    # machine shifts every estimate; a plain pass (every sequence fed one token) is further
    # multiplied by its own slowly learnt factor (module docstring).
    verify_scale: float = 1.0
    draft_scale: float = 1.0
    sampled_verify_scale: float = 1.0
    sampled_draft_scale: float = 1.0
    plain_verify_factor: float = 1.0
    sampled_plain_verify_factor: float = 1.0
    rounds_seen: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        # Each row made non-decreasing in tokens per sequence (_non_decreasing): at batch 1 a pass
        # costs the same for 1 to 6 tokens within +-0.3 ms of noise, and a cell measured low would
        # tell the policy that drafting makes verifying cheaper.
        self._grid = np.array([_non_decreasing(row) for row in self.verify_grid], dtype=np.float64)
        self._batches = np.asarray(self.batch_sizes, dtype=np.float64)
        self._tokens = np.asarray(self.verify_tokens, dtype=np.float64)
        self._draft = np.asarray(self.draft_step, dtype=np.float64)
        self._rows: dict[float, np.ndarray] = {}  # verify_row by batch size: the policy asks each round
        self._row_lists: dict[float, list[float]] = {}  # the same as lists, for scalar lookups (observe)
        self._token_list = [float(t) for t in self.verify_tokens]
        self._steps_by_count: dict[int, np.ndarray] = {}
        self._step_lists: dict[int, list[float]] = {}  # the same as lists, for scalar lookups
        if self.catch_up_token_seconds is None:
            self.catch_up_token_seconds = float(self._draft[-1] / self._batches[-1])

    def effective_tokens(self, mean: float | np.ndarray, longest: float | np.ndarray) -> float | np.ndarray:
        """Tokens per sequence of the uniform pass that costs what a ragged one does."""
        if isinstance(longest, (int, float)):
            return mean + self.ragged_share * (longest - mean)
        return mean + self.ragged_share * (np.asarray(longest) - mean)

    def verify_row(self, batch: float) -> np.ndarray:
        """Unscaled verify seconds at this batch size for each of verify_tokens."""
        row = self._rows.get(batch)
        if row is None:
            row = self._rows[batch] = self._interpolated_row(batch)
        return row

    def _interpolated_row(self, batch: float) -> np.ndarray:
        b = self._batches
        i = int(np.clip(np.searchsorted(b, batch) - 1, 0, max(len(b) - 2, 0)))
        if len(b) == 1:
            return self._grid[0]
        w = min(max((batch - b[i]) / (b[i + 1] - b[i]), 0.0), 1.0)
        return (1 - w) * self._grid[i] + w * self._grid[i + 1]

    def draft_factor(self, sampled: bool = False) -> float:
        """What the measured (greedy) draft figures are multiplied by for this kind of round."""
        return self.sampled_draft_factor * self.sampled_draft_scale if sampled else self.draft_scale

    def accept_seconds(self, batch: float) -> float:
        """The sampled accept test's extra time in a verify pass over `batch` sequences."""
        if not self.sampled_batches:
            return 0.0
        return _interp(batch, self.sampled_batches, self.sampled_accept_seconds)

    def grid_seconds(self, batch: float, tokens_per_seq: float | np.ndarray) -> float | np.ndarray:
        """The measured greedy verify time: bilinear interpolation, the last slope beyond the grid."""
        if isinstance(tokens_per_seq, (int, float)):
            return self._grid_scalar(batch, float(tokens_per_seq))
        row, t = self.verify_row(batch), self._tokens
        value = np.interp(tokens_per_seq, t, row)
        if len(t) > 1:
            slope = (row[-1] - row[-2]) / (t[-1] - t[-2])
            value = np.where(np.asarray(tokens_per_seq) > t[-1], row[-1] + (tokens_per_seq - t[-1]) * slope, value)
        return value if np.ndim(value) else float(value)

    def _grid_scalar(self, batch: float, tokens: float) -> float:
        """grid_seconds for one number of tokens, in plain Python: observe() asks once a round, and
        numpy's per-call overhead on scalars (about 40 us) was a third of the policy's round time."""
        row = self._row_lists.get(batch)
        if row is None:
            row = self._row_lists[batch] = [float(x) for x in self.verify_row(batch)]
        t = self._token_list
        if len(t) > 1 and tokens > t[-1]:  # (operations in numpy's order: the same bits as the array path)
            return row[-1] + (tokens - t[-1]) * ((row[-1] - row[-2]) / (t[-1] - t[-2]))
        return _interp(tokens, t, row)

    def verify_seconds(self, batch: float, tokens_per_seq: float | np.ndarray,
                       sampled: bool = False) -> float | np.ndarray:
        """A verify pass, corrected (a plain one by its factor too); a sampled one that verifies
        proposals (more than one token per sequence on average) adds the accept test, under the
        same correction."""
        drafting = np.asarray(tokens_per_seq) > 1
        value = self.grid_seconds(batch, tokens_per_seq)
        if sampled:
            value = value + np.where(drafting, self.accept_seconds(batch), 0.0)
            value = value * self.sampled_verify_scale * np.where(drafting, 1.0, self.sampled_plain_verify_factor)
        else:
            value = value * self.verify_scale * np.where(drafting, 1.0, self.plain_verify_factor)
        return value if np.ndim(value) else float(value)

    def lone_round_seconds(self, k: int, sampled: bool = False) -> float:
        """A round of one sequence drafting k tokens (0: a plain step): what the policy's batch
        pricing (SpeculationPolicy._round_seconds) gives a batch of one, in plain Python. The
        policy prices every K of a lone request each round, and numpy's per-call overhead on arrays
        this small made that 0.2 ms, 2-3% of a batch-1 round on the dev machine."""
        verify = self._grid_scalar(1, k + 1.0)
        if sampled:
            verify = (verify + self.accept_seconds(1)) * self.sampled_verify_scale if k else \
                verify * self.sampled_verify_scale * self.sampled_plain_verify_factor
        else:
            verify = verify * self.verify_scale * (1.0 if k else self.plain_verify_factor)
        draft = (k * self._step_list(1)[1] + self.draft_call_seconds) * self.draft_factor(sampled) if k else 0.0
        return verify + draft + self.overhead_seconds

    def draft_steps_by_count(self, batch: int) -> np.ndarray:
        """draft_step_seconds(n) for n = 0 .. batch, looked up by the policy every round."""
        table = self._steps_by_count.get(batch)
        if table is None:
            table = self._steps_by_count[batch] = self.draft_step_seconds(np.arange(batch + 1))
        return table

    def _step_list(self, batch: int) -> list[float]:
        table = self._step_lists.get(batch)
        if table is None:
            table = self._step_lists[batch] = [float(x) for x in self.draft_steps_by_count(batch)]
        return table

    def draft_step_seconds(self, sequences: np.ndarray) -> np.ndarray:
        """Unscaled seconds of draft steps advancing that many sequences each (0: no step)."""
        return np.interp(sequences, self._batches, self._draft) * (np.asarray(sequences) > 0)

    def draft_seconds(self, steps: list[int] | np.ndarray, sampled: bool = False) -> float:
        """A draft call whose step s advances steps[s] sequences (0 steps: no call). In plain
        Python, like the other lookups observe() makes every round."""
        counts = [int(n) for n in steps if n > 0]
        if not counts:
            return 0.0
        table = self._step_list(max(counts))
        return (self.draft_call_seconds + sum(table[n] for n in counts)) * self.draft_factor(sampled)

    def catch_up_seconds(self, tokens: int, sampled: bool = False) -> float:
        """What feeding the drafter `tokens` tokens it has not seen (a prompt, tokens committed at
        K = 0) beyond one round's worth adds to a call."""
        return tokens * self.catch_up_token_seconds * self._draft_load(sampled)

    def _draft_load(self, sampled: bool) -> float:
        """The online correction of draft times alone (no sampled factor: catch-up samples nothing)."""
        return self.sampled_draft_scale if sampled else self.draft_scale

    def observe(self, report: RoundReport, sampled: bool = False) -> None:
        """Fold a round's measured times into the corrections (`sampled`: a round with a sampled
        request in it)."""
        ran = [u for u in report.updates if not u.finished or u.token_ids]
        if not report.ran or not ran:
            return
        prefix = "sampled_" if sampled else ""
        fed = [u.proposed + 1 for u in ran]
        tokens = self.effective_tokens(sum(fed) / len(fed), max(fed))
        accept = self.accept_seconds(len(ran)) if sampled and tokens > 1 else 0.0
        if not report.target_prefill:  # a pass that first fed prompts says nothing about verifying
            grid, scale = self.grid_seconds(len(ran), tokens) + accept, prefix + "verify_scale"
            if tokens > 1:
                self._correct(scale, report.verify_seconds, grid)
            else:  # both from their values before this round
                factor, scaled = prefix + "plain_verify_factor", grid * getattr(self, scale)
                self._correct(scale, report.verify_seconds, grid * getattr(self, factor))
                self._correct(factor, report.verify_seconds, scaled, _FACTOR_REFRESH)
        asked = [u.num_speculative_tokens for u in ran]
        if max(asked) > 0 and report.draft_seconds > 0:
            steps = [sum(1 for k in asked if k > s) for s in range(max(asked))]
            if report.draft_catch_up:  # what the call took beyond its steps prices the catch-up tokens
                beyond = report.draft_seconds - self.draft_seconds(steps, sampled)
                if beyond > 0:
                    per_token = beyond / report.draft_catch_up / self._draft_load(sampled)
                    self.catch_up_token_seconds += _REFRESH * (per_token - self.catch_up_token_seconds)
            else:  # (a call that fed a backlog would price every later step as if it carried one)
                unscaled = self.draft_seconds(steps, sampled) / getattr(self, prefix + "draft_scale")
                self._correct(prefix + "draft_scale", report.draft_seconds, unscaled)
        self.overhead_seconds += _REFRESH * (report.overhead_seconds - self.overhead_seconds)
        self.rounds_seen += 1

    def _correct(self, scale: str, measured: float, unscaled: float, rate: float = _REFRESH) -> None:
        """Move one online correction a step towards measured / (the prediction it multiplies)."""
        if unscaled > 0 and measured > 0:
            current = getattr(self, scale)
            setattr(self, scale, current + rate * (measured / unscaled - current))

    def to_json(self) -> dict:
        """The measured figures, for the cost cache (saved right after measuring, so the catch-up
        price is still the measured one), without the online corrections."""
        data = asdict(self)
        for online in ("verify_scale", "draft_scale", "sampled_verify_scale", "sampled_draft_scale",
                       "plain_verify_factor", "sampled_plain_verify_factor", "rounds_seen"):
            data.pop(online)
        return data

    @staticmethod
    def from_json(data: dict) -> RoundCosts:
        return RoundCosts(**data)


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """np.interp at one point (xs ascending), in plain Python and in numpy's order of operations:
    numpy's per-call cost on a scalar is tens of microseconds once a round's forward passes have
    evicted it from the caches."""
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1])
    i = bisect.bisect_right(xs, x) - 1
    return (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) * (x - xs[i]) + ys[i]


def _non_decreasing(values: list[float]) -> list[float]:
    """Each cell the least of itself and every cell after it. A pass over more tokens never costs
    less, and a timing only ever errs upwards (interference adds time), so that is the tightest
    bound the row's measurements give on each cell. (Averaging violators instead let one spike
    in the 1-token cell at batch 8, 32 ms against 15 ms beside it, price every plain round
    at 21 ms, and drafting, beside it, as nearly free.)"""
    out = [float(v) for v in values]
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def measurement_grid(max_batch_size: int, max_speculative_tokens: int) -> tuple[list[int], list[int]]:
    """Batch sizes in powers of two; every draft length up to 8, beyond that a spread of them."""
    batches = sorted({min(b, max_batch_size) for b in (1, 2, 4, 8, 16, 32, 64)})
    top = max_speculative_tokens + 1
    tokens = list(range(1, top + 1)) if top <= 9 else sorted({*range(1, 8), top // 2, top})
    return batches, tokens


def _timed_round(target: TargetClient, draft: DraftClient | None, unsent: dict[str, list[int]], k: int,
                 params: SamplingParams, rng: np.random.Generator, vocab_size: int) -> tuple[float, float]:
    """One round over every request in `unsent` (req_id -> tokens the drafter has not seen):
    (seconds drafting k tokens each, seconds verifying k + 1 tokens each)."""
    start = time.perf_counter()
    proposals = {}
    if draft is not None and k > 0:
        tasks = [DraftTask(r, tokens, k, params) for r, tokens in unsent.items()]
        proposals = {p.req_id: p for p in draft.propose(tasks, [])}
        for tokens in unsent.values():
            tokens.clear()
    drafted = time.perf_counter()
    if params.greedy:  # padded to k tokens: the pass is timed with k + 1 per sequence whatever was found
        found = {r: proposals[r].tokens if r in proposals else [] for r in unsent}
        padding = {r: [int(x) for x in rng.integers(0, vocab_size, k)] for r in unsent}
        tasks = [VerifyTask(r, [], (found[r] + padding[r])[:k], None, params) for r in unsent]
    else:  # a sampled proposal is verified against the q it was drawn from, as served; where the
        # drafter found fewer than k tokens (an n-gram drafter on random text) a random proposal
        # of the same q width stands in, so the pass is timed at k + 1 per sequence all the same
        width = max([p.q.token_ids.shape[1] for p in proposals.values() if p.q is not None and p.tokens],
                    default=_RANDOM_Q_WIDTH)
        tasks = []
        for r in unsent:
            found = proposals.get(r)
            complete = found is not None and len(found.tokens) == k and found.q is not None
            tokens, q = (found.tokens, found.q) if complete else _random_proposal(k, width, rng, vocab_size)
            tasks.append(VerifyTask(r, [], tokens, q, params))
    result = target.verify(tasks, [])
    for outcome in result.outcomes:
        unsent[outcome.req_id] += outcome.tokens
    return drafted - start, time.perf_counter() - drafted


def _random_proposal(k: int, width: int, rng: np.random.Generator, vocab_size: int) -> tuple[list[int], SparseDist]:
    """k random draft tokens, each proposed with a uniform q over `width` random ids (itself among them)."""
    width = min(width, vocab_size)
    ids = torch.tensor(np.stack([rng.choice(vocab_size, width, replace=False) for _ in range(k)]), dtype=torch.long)
    return ids[:, 0].tolist(), SparseDist(token_ids=ids, probs=torch.full((k, width), 1.0 / width))


@contextmanager
def _throwaway_requests(target: TargetClient, draft: DraftClient | None, ids: list[str], prompt_tokens: int,
                        params: SamplingParams, rng: np.random.Generator, vocab_size: int):
    """Prefill the target with requests `ids` of random prompts; yields req_id -> the tokens the
    drafter has not seen (all of them); releases the requests at the end, whatever happens."""
    unsent = {r: [int(t) for t in rng.integers(0, vocab_size, prompt_tokens)] for r in ids}
    try:
        prefill = target.verify([VerifyTask(r, unsent[r], [], None, params) for r in ids], [])
        for outcome in prefill.outcomes:
            unsent[outcome.req_id] += outcome.tokens
        yield unsent
    finally:
        target.verify([], ids)
        if draft is not None:
            draft.propose([], ids)


def _time_batch(target: TargetClient, draft: DraftClient | None, ids: list[str], draft_lengths: list[int],
                repeats: int, params: SamplingParams, prompt_tokens: int, rng: np.random.Generator,
                vocab_size: int) -> tuple[list[float], list[float]]:
    """Fastest (draft seconds, verify seconds) of `repeats` rounds at each draft length, over the
    throw-away requests `ids` (released at the end, whatever happens). The lengths take turns,
    deepest first, so a slow spell of the machine touches every cell alike rather than all repeats
    of one (the 1-token cell at batch 8 once measured 32 ms beside 15 ms). The plain pass (k = 0)
    comes last: the next attempt's deepest call first feeds the drafter the token it committed,
    a sliver of that call's time (of the 1-step call's, which prices a call's own cost, a share
    that counts)."""
    with _throwaway_requests(target, draft, ids, prompt_tokens, params, rng, vocab_size) as unsent:
        draft_times, verify_times = [float("inf")] * len(draft_lengths), [float("inf")] * len(draft_lengths)
        for attempt in range(repeats + 1):
            for i in reversed(range(len(draft_lengths))):
                drafting, verifying = _timed_round(target, draft, unsent, draft_lengths[i], params, rng, vocab_size)
                if attempt:  # the first is a warm-up
                    draft_times[i], verify_times[i] = min(draft_times[i], drafting), min(verify_times[i], verifying)
        return draft_times, verify_times


def _ragged_share(target: TargetClient, batch: int, top: int, repeats: int, params: SamplingParams,
                  context_tokens: int, rng: np.random.Generator, vocab_size: int) -> float:
    """Where between the uniform passes around it (every sequence fed 1 token, every one fed
    `top`) a pass in which half the sequences verify `top` tokens and the others 1 costs, as a
    share of the way from the straight line at their mean to the longest. Timed greedy at
    `batch` sequences of `context_tokens` (ids "calibrate-ragged-<i>", released at the end): the
    padding is attention's, which grows with the context, so it is timed at a serving-like
    length rather than the grid's short one."""
    ids = [f"calibrate-ragged-{i}" for i in range(batch)]
    shapes = {"low": [1] * batch, "high": [top] * batch, "ragged": [top if i % 2 else 1 for i in range(batch)]}
    with _throwaway_requests(target, None, ids, context_tokens, params, rng, vocab_size):
        best = dict.fromkeys(shapes, float("inf"))
        for attempt in range(repeats + 1):
            for name, fed in shapes.items():
                tasks = [VerifyTask(r, [], [int(t) for t in rng.integers(0, vocab_size, n - 1)], None, params)
                         for r, n in zip(ids, fed)]
                start = time.perf_counter()
                target.verify(tasks, [])
                if attempt:  # the first is a warm-up
                    best[name] = min(best[name], time.perf_counter() - start)
    mean = sum(shapes["ragged"]) / batch
    at_mean = best["low"] + (mean - 1) / (top - 1) * (best["high"] - best["low"])
    if best["high"] <= at_mean:
        return 0.0
    return float(np.clip((best["ragged"] - at_mean) / (best["high"] - at_mean), 0.0, 1.0))


def _catch_up_token_seconds(target: TargetClient, draft: DraftClient, batch: int, context_tokens: int,
                            params: SamplingParams, rng: np.random.Generator, vocab_size: int,
                            one_step_seconds: float) -> float:
    """Seconds per token of a draft call that first feeds `batch` prompts of `context_tokens` the
    drafter has not seen (ids "calibrate-catch-up-<i>", released at the end), less the one draft
    step it then takes: what catching up costs, as new requests and requests back from K = 0 pay it."""
    ids = [f"calibrate-catch-up-{i}" for i in range(batch)]
    with _throwaway_requests(target, draft, ids, context_tokens, params, rng, vocab_size) as unsent:
        fed = sum(len(tokens) for tokens in unsent.values())
        start = time.perf_counter()
        draft.propose([DraftTask(r, tokens, 1, params) for r, tokens in unsent.items()], [])
        seconds = time.perf_counter() - start
    return max(seconds - one_step_seconds, 0.0) / max(fed, 1)


def measure_round_costs(target: TargetClient, draft: DraftClient | None, max_seq_len: int, max_batch_size: int,
                        max_speculative_tokens: int, repeats: int = 4) -> RoundCosts:
    """Time real rounds over a grid of batch sizes and draft lengths: the drafter proposes for
    throw-away greedy requests (ids "calibrate-<batch>-<i>"), the target verifies, the committed
    tokens go back to the drafter, as in serving. Interleaving matters: a draft step right after a
    target pass runs with the target's weights in the caches, about twice as slow as back-to-back
    draft steps. Each cell keeps its fastest repeat (interference only ever adds time). Then the
    deepest rounds of the smallest and the largest batch, greedy and sampled back to back
    (_sampled_extra): the accept test's time and the sampled draft factor; and
    ragged passes at the largest batch (_ragged_share), and the drafter's catch-up on prompts
    there (_catch_up_token_seconds). Batch
    sizes whose sequences would not fit the target's KV cache are left out; every request is
    released."""
    info = target.info()
    batches, tokens = measurement_grid(max_batch_size, max_speculative_tokens)
    growth = (repeats + 1) * sum(tokens) + 1  # at most t tokens committed per timed round
    room = info.kv_blocks_total * info.kv_block_size // batches[-1] - 2 * info.kv_block_size
    while batches[1:] and room < growth + 1:  # the largest batches do not fit: measure fewer
        batches.pop()
        room = info.kv_blocks_total * info.kv_block_size // batches[-1] - 2 * info.kv_block_size
    while repeats > 1 and min(room, max_seq_len) < growth + 8:  # a small model: fewer repeats
        repeats -= 1
        growth = (repeats + 1) * sum(tokens) + 1
    prompt_tokens = max(1, min(32, max_seq_len - growth, room - growth))  # (the sampled pairs: a difference)
    grid_prompt = max(prompt_tokens, min(SERVING_CONTEXT - growth, max_seq_len - growth, room - growth))
    greedy = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)
    rng = np.random.default_rng(0)
    grid, draft_step, draft_call = [], [], []
    for b in batches:
        draft_times, row = _time_batch(target, draft, [f"calibrate-{b}-{i}" for i in range(b)],
                                       [t - 1 for t in tokens], repeats, greedy, grid_prompt, rng, info.vocab_size)
        grid.append(row)
        if draft is not None:
            deepest = tokens[-1] - 1
            per_step = max((draft_times[-1] - draft_times[1]) / max(deepest - 1, 1), 0.0)
            draft_step.append(per_step)
            draft_call.append(max(draft_times[1] - per_step, 0.0))
        else:
            draft_step.append(0.0)
    costs = RoundCosts(batch_sizes=batches, verify_tokens=tokens, verify_grid=grid, draft_step=draft_step,
                       draft_call_seconds=float(np.median(draft_call)) if draft_call else 0.0)
    # Each attempt of the ragged timing grows a sequence by at most 1 + top + top tokens.
    context = min(SERVING_CONTEXT, max_seq_len // 2, room) - (repeats + 1) * (2 * tokens[-1] + 1)
    if batches[-1] > 1 and tokens[-1] > 1 and context >= 8:  # (a tiny model: no ragged pricing)
        costs.ragged_share = _ragged_share(target, batches[-1], tokens[-1], repeats, greedy, context, rng,
                                           info.vocab_size)
    if draft is not None and context >= 8:
        one_step = costs.draft_seconds([batches[-1]])
        costs.catch_up_token_seconds = _catch_up_token_seconds(target, draft, batches[-1], context, greedy, rng,
                                                               info.vocab_size, one_step)
    if draft is not None and tokens[-1] > 1:
        sampled, k = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True, temperature=1.0, seed=0), tokens[-1] - 1
        # 2b sequences at once (a greedy and a sampled set), each growing by up to `top` tokens
        # in each of 2 (repeats + 1) rounds: a small cache or context measures what fits.
        length = prompt_tokens + 2 * (repeats + 1) * tokens[-1] + 1
        capacity = info.kv_blocks_total * info.kv_block_size
        for b in sorted({batches[0], batches[-1]}):
            if length >= max_seq_len or 2 * b * (length + 2 * info.kv_block_size) > capacity:
                continue  # (sampled rounds then priced as greedy ones)
            accept, factor = _sampled_extra(target, draft, b, k, 2 * repeats + 1, greedy, sampled, prompt_tokens,
                                            rng, info.vocab_size)
            costs.sampled_batches.append(b)
            costs.sampled_accept_seconds.append(accept)
            costs.sampled_draft_factor = factor  # the largest batch measured has the last word
    return costs


def _sampled_extra(target: TargetClient, draft: DraftClient, batch: int, k: int, repeats: int,
                   greedy: SamplingParams, sampled: SamplingParams, prompt_tokens: int, rng: np.random.Generator,
                   vocab_size: int) -> tuple[float, float]:
    """(accept test seconds, sampled draft factor) at `batch` sequences drafting k: a greedy and a
    sampled round back to back (ids "calibrate-greedy-<b>-<i>", "calibrate-sampled-<b>-<i>",
    released at the end), `repeats` times after a warm-up; the median sampled - greedy verify
    time, and the median sampled / greedy draft time (at least 1)."""
    extra, factors = [], []
    with (_throwaway_requests(target, draft, [f"calibrate-greedy-{batch}-{i}" for i in range(batch)],
                              prompt_tokens, greedy, rng, vocab_size) as plain,
          _throwaway_requests(target, draft, [f"calibrate-sampled-{batch}-{i}" for i in range(batch)],
                              prompt_tokens, sampled, rng, vocab_size) as drawn):
        for attempt in range(repeats + 1):
            greedy_draft, greedy_verify = _timed_round(target, draft, plain, k, greedy, rng, vocab_size)
            sampled_draft, sampled_verify = _timed_round(target, draft, drawn, k, sampled, rng, vocab_size)
            if attempt:  # the first is a warm-up
                extra.append(sampled_verify - greedy_verify)
                factors.append(sampled_draft / max(greedy_draft, 1e-9))
    return max(float(np.median(extra)), 0.0), max(float(np.median(factors)), 1.0)
