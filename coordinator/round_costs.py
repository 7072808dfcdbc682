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

    def verify_seconds(self, batch: float, tokens_per_seq: float) -> float:
        """Bilinear interpolation (linear extrapolation in tokens beyond the grid)."""
        b = np.asarray(self.batch_sizes, dtype=np.float64)
        t = np.asarray(self.verify_tokens, dtype=np.float64)
        grid = np.asarray(self.verify_grid)
        by_batch = np.array([np.interp(batch, b, grid[:, j]) for j in range(len(t))])
        value = np.interp(tokens_per_seq, t, by_batch)
        if tokens_per_seq > t[-1] and len(t) > 1:  # beyond the grid: keep the last slope
            value = by_batch[-1] + (tokens_per_seq - t[-1]) * (by_batch[-1] - by_batch[-2]) / (t[-1] - t[-2])
        return float(value) * self.verify_scale

    def draft_seconds(self, steps: list[int] | np.ndarray) -> float:
        """A draft call whose step s advances steps[s] sequences (0 steps: no call)."""
        steps = [n for n in steps if n > 0]
        if not steps:
            return 0.0
        per_step = np.interp(steps, self.batch_sizes, self.draft_step)
        return (self.draft_call_seconds + float(per_step.sum())) * self.draft_scale

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
    batches = sorted({min(b, max_batch_size) for b in (1, 2, 4, 8, 16, 32)})
    tokens = sorted({1, 2, 3, max(1, max_speculative_tokens // 2) + 1, max_speculative_tokens + 1})
    return batches, tokens


def measure_round_costs(target: TargetClient, draft: DraftClient | None, max_seq_len: int, max_batch_size: int,
                        max_speculative_tokens: int, repeats: int = 3) -> RoundCosts:
    """Time verify passes and draft steps over a grid of batch sizes and draft lengths, with
    throw-away greedy requests (ids "calibrate-<batch>-<i>"; every one is released). Batch sizes
    whose sequences would not fit the target's KV cache are left out of the grid."""
    info = target.info()
    batches, tokens = measurement_grid(max_batch_size, max_speculative_tokens)
    growth = repeats * len(tokens) + tokens[-1] + 1  # each timed pass commits at least one token
    room = info.kv_blocks_total * info.kv_block_size // batches[-1] - 2 * info.kv_block_size
    while batches[1:] and room < growth + 1:  # the largest batches do not fit: measure fewer
        batches.pop()
        room = info.kv_blocks_total * info.kv_block_size // batches[-1] - 2 * info.kv_block_size
    prompt_tokens = max(1, min(32, max_seq_len - growth, room - growth))
    vocab_size = info.vocab_size
    params = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)
    rng = np.random.default_rng(0)
    grid, draft_step, draft_call = [], [], []
    for b in batches:
        ids = [f"calibrate-{b}-{i}" for i in range(b)]
        prompts = [[int(t) for t in rng.integers(0, vocab_size, prompt_tokens)] for _ in ids]
        try:
            target.verify([VerifyTask(r, p, [], None, params) for r, p in zip(ids, prompts)], [])  # prefill
            row = []
            for t in tokens:
                times = []
                for _ in range(repeats):
                    tasks = [VerifyTask(r, [], [int(x) for x in rng.integers(0, vocab_size, t - 1)], None, params)
                             for r in ids]
                    start = time.perf_counter()
                    target.verify(tasks, [])
                    times.append(time.perf_counter() - start)
                row.append(float(np.median(times)))
            grid.append(row)
            if draft is not None:
                draft.propose([DraftTask(r, p, 0, params) for r, p in zip(ids, prompts)], [])
                steps = max(max_speculative_tokens, 2)
                timed = {1: [], steps: []}
                for _ in range(repeats):
                    for k, record in timed.items():
                        start = time.perf_counter()
                        draft.propose([DraftTask(r, [], k, params) for r in ids], [])
                        record.append(time.perf_counter() - start)
                one, many = float(np.median(timed[1])), float(np.median(timed[steps]))
                per_step = max((many - one) / (steps - 1), 0.0)
                draft_step.append(per_step)
                draft_call.append(max(one - per_step, 0.0))
            else:
                draft_step.append(0.0)
        finally:
            target.verify([], ids)
            if draft is not None:
                draft.propose([], ids)
    return RoundCosts(batch_sizes=batches, verify_tokens=tokens, verify_grid=grid, draft_step=draft_step,
                      draft_call_seconds=float(np.median(draft_call)) if draft_call else 0.0)
