"""What a round costs on this machine: measured at start-up through the round protocol itself,
refreshed from every RoundReport.

Terms:
- verify pass: one target call over b sequences, each fed t tokens (t = its K + 1);
  `verify_seconds(b, t)` interpolates a grid measured over batch sizes and tokens per sequence;
- draft step: one batched forward of the drafter over the n sequences still drafting; a draft
  call of K steps costs `draft_call_seconds + sum over steps of draft_step_seconds(n_step)`;
- overhead: the coordinator's own time per round (scheduling, stop conditions, streaming).

Measuring through DraftClient / TargetClient (not the models directly) prices what the policy
actually pays, transport included, in process and over gRPC alike.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np

from coordinator.clients import DraftClient, TargetClient
from coordinator.round_report import RoundReport
from specdec.params import SamplingParams
from specdec.round_types import DraftTask, VerifyTask

_REFRESH = 0.1  # weight of each new round in the online corrections


@dataclass
class RoundCosts:
    batch_sizes: list[int]  # grid of the measurements, ascending
    verify_tokens: list[int]  # tokens per sequence of the verify grid, ascending, starts at 1
    verify_grid: list[list[float]]  # seconds, [batch][tokens]
    draft_step: list[float]  # seconds of one draft step, per batch size
    draft_call_seconds: float = 0.0  # a draft call's cost beyond its steps (transport, sync)
    overhead_seconds: float = 0.0
    # Online corrections (measured / predicted), so a loaded machine shifts every estimate.
    verify_scale: float = 1.0
    draft_scale: float = 1.0
    rounds_seen: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        # Measured as is, not forced monotone: on a CPU a 2- to 4-row product can be slower than a
        # 6-row one (the BLAS picks another kernel), so verifying 5 tokens may cost less than 3.
        self._grid = np.asarray(self.verify_grid, dtype=np.float64)
        self._batches = np.asarray(self.batch_sizes, dtype=np.float64)
        self._tokens = np.asarray(self.verify_tokens, dtype=np.float64)
        self._draft = np.asarray(self.draft_step, dtype=np.float64)

    def verify_row(self, batch: float) -> np.ndarray:
        """Unscaled verify seconds at this batch size for each of verify_tokens."""
        b = self._batches
        i = int(np.clip(np.searchsorted(b, batch) - 1, 0, max(len(b) - 2, 0)))
        if len(b) == 1:
            return self._grid[0]
        w = min(max((batch - b[i]) / (b[i + 1] - b[i]), 0.0), 1.0)
        return (1 - w) * self._grid[i] + w * self._grid[i + 1]

    def verify_seconds(self, batch: float, tokens_per_seq: float | np.ndarray) -> float | np.ndarray:
        """Bilinear interpolation, linear extrapolation in tokens beyond the grid."""
        row, t = self.verify_row(batch), self._tokens
        value = np.interp(tokens_per_seq, t, row)
        if len(t) > 1:  # beyond the grid: keep the last slope
            slope = (row[-1] - row[-2]) / (t[-1] - t[-2])
            value = np.where(np.asarray(tokens_per_seq) > t[-1], row[-1] + (tokens_per_seq - t[-1]) * slope, value)
        return value * self.verify_scale if np.ndim(value) else float(value) * self.verify_scale

    def draft_step_seconds(self, sequences: np.ndarray) -> np.ndarray:
        """Unscaled seconds of draft steps advancing that many sequences each (0: no step)."""
        return np.interp(sequences, self._batches, self._draft) * (np.asarray(sequences) > 0)

    def draft_seconds(self, steps: list[int] | np.ndarray) -> float:
        """A draft call whose step s advances steps[s] sequences (0 steps: no call)."""
        steps = np.asarray([n for n in steps if n > 0])
        if not steps.size:
            return 0.0
        return (self.draft_call_seconds + float(self.draft_step_seconds(steps).sum())) * self.draft_scale

    def observe(self, report: RoundReport) -> None:
        """Fold a round's measured times into the corrections."""
        ran = [u for u in report.updates if not u.finished or u.token_ids]
        if not report.ran or not ran:
            return
        tokens = sum(u.proposed + 1 for u in ran) / len(ran)
        predicted = self.verify_seconds(len(ran), tokens) / self.verify_scale
        if predicted > 0 and report.verify_seconds > 0:
            self.verify_scale += _REFRESH * (report.verify_seconds / predicted - self.verify_scale)
        asked = np.array([u.num_speculative_tokens for u in ran])
        if asked.max(initial=0) > 0 and report.draft_seconds > 0:
            steps = [(asked > s).sum() for s in range(int(asked.max()))]
            predicted = self.draft_seconds(steps) / self.draft_scale
            if predicted > 0:
                self.draft_scale += _REFRESH * (report.draft_seconds / predicted - self.draft_scale)
        self.overhead_seconds += _REFRESH * (report.overhead_seconds - self.overhead_seconds)
        self.rounds_seen += 1

    def to_json(self) -> dict:
        data = asdict(self)
        for online in ("verify_scale", "draft_scale", "rounds_seen"):
            data.pop(online)
        return data

    @staticmethod
    def from_json(data: dict) -> RoundCosts:
        return RoundCosts(**data)


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
        proposals = {p.req_id: p.tokens for p in draft.propose(tasks, [])}
        for tokens in unsent.values():
            tokens.clear()
    drafted = time.perf_counter()
    # Padded to k tokens: the pass is timed with k + 1 per sequence whatever the drafter found.
    drafts = {r: (proposals.get(r, []) + [int(x) for x in rng.integers(0, vocab_size, k)])[:k] for r in unsent}
    result = target.verify([VerifyTask(r, [], drafts[r], None, params) for r in unsent], [])
    for outcome in result.outcomes:
        unsent[outcome.req_id] += outcome.tokens
    return drafted - start, time.perf_counter() - drafted


def measure_round_costs(target: TargetClient, draft: DraftClient | None, max_seq_len: int, max_batch_size: int,
                        max_speculative_tokens: int, repeats: int = 4) -> RoundCosts:
    """Time real rounds over a grid of batch sizes and draft lengths: the drafter proposes for
    throw-away greedy requests (ids "calibrate-<batch>-<i>"), the target verifies, the committed
    tokens go back to the drafter, as in serving. Interleaving matters: a draft step right after a
    target pass runs with the target's weights in the caches, about twice as slow as back-to-back
    draft steps. Each cell keeps its fastest repeat (interference only ever adds time). Batch sizes
    whose sequences would not fit the target's KV cache are left out; every request is released."""
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
    prompt_tokens = max(1, min(32, max_seq_len - growth, room - growth))
    params = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)
    rng = np.random.default_rng(0)
    grid, draft_step, draft_call = [], [], []
    for b in batches:
        ids = [f"calibrate-{b}-{i}" for i in range(b)]
        unsent = {r: [int(t) for t in rng.integers(0, info.vocab_size, prompt_tokens)] for r in ids}
        try:
            prefill = target.verify([VerifyTask(r, unsent[r], [], None, params) for r in ids], [])
            for outcome in prefill.outcomes:  # the drafter has not seen any of it yet
                unsent[outcome.req_id] += outcome.tokens

            row, draft_times = [], {}
            for t in tokens:
                timed = [_timed_round(target, draft, unsent, t - 1, params, rng, info.vocab_size)
                         for _ in range(repeats + 1)][1:]  # the first is a warm-up
                row.append(min(v for _, v in timed))
                draft_times[t - 1] = min(d for d, _ in timed)
            grid.append(row)
            if draft is not None:
                deepest = tokens[-1] - 1
                per_step = max((draft_times[deepest] - draft_times[1]) / max(deepest - 1, 1), 0.0)
                draft_step.append(per_step)
                draft_call.append(max(draft_times[1] - per_step, 0.0))
            else:
                draft_step.append(0.0)
        finally:
            target.verify([], ids)
            if draft is not None:
                draft.propose([], ids)
    return RoundCosts(batch_sizes=batches, verify_tokens=tokens, verify_grid=grid, draft_step=draft_step,
                      draft_call_seconds=float(np.median(draft_call)) if draft_call else 0.0)
