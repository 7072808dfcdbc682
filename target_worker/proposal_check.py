"""The target does not trust the draft worker: a proposal is checked before it is verified.

A faulty or hostile drafter could otherwise push tokens into the output: a token proposed with
q = 0 passes `u * q < p` whenever p > 0, and a q that is not a distribution breaks the accept
test's arithmetic. A proposal that fails these checks fails its own request, with the reason;
the other requests of the round go on.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.round_types import VerifyTask
from specdec.sampling.tree import tree_problem

# float32 rows of at most a few hundred entries sum to 1 within ~1e-6 when they were normalised.
_SUM_TOLERANCE = 1e-4


def proposal_problems(tasks: list[VerifyTask], vocab_size: int) -> dict[str, str]:
    """Why each task that cannot be verified cannot be, by request id. The q checks of the whole
    round read one flag per task back from q's device at once (one host sync, not one per check
    and task); a failed task's reason is then worked out on its own."""
    problems = {t.req_id: why for t in tasks if (why := _host_problem(t, vocab_size))}
    checked = [t for t in tasks if t.req_id not in problems and _needs_q(t)]
    if checked:
        device = checked[0].q.probs.device
        checks = [_q_checks(t, vocab_size) for t in checked]
        flags = torch.stack([torch.stack([flag for flag, _ in c]).all().to(device) for c in checks]).tolist()
        problems.update({t.req_id: _first_failure(c) for t, c, ok in zip(checked, checks, flags) if not ok})
    return problems


def _needs_q(task: VerifyTask) -> bool:
    return not task.params.greedy and bool(task.draft_tokens)  # greedy verification compares tokens


def _host_problem(task: VerifyTask, vocab_size: int) -> str | None:
    bad = [t for t in task.draft_tokens if not 0 <= t < vocab_size]
    if bad:
        return f"draft token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
    if task.parents and (why := tree_problem(task.parents, len(task.draft_tokens))):
        return why
    q = task.q
    if _needs_q(task) and (q is None or q.num_positions != len(task.draft_tokens)):
        rows = 0 if q is None else q.num_positions
        return f"a sampled request needs q for each of its {len(task.draft_tokens)} draft tokens, got {rows}"
    return None


def _q_checks(task: VerifyTask, vocab_size: int) -> list[tuple[torch.Tensor, Callable[[], str]]]:
    """Each check of q, in order: (a 0-d bool on q's device, True where it passes: no host sync;
    the reason, worked out only for a check that fails)."""
    ids, probs = task.q.token_ids.long(), task.q.probs.double()  # [K, n] each
    in_vocab = (ids >= 0) & (ids < vocab_size)
    sums = probs.sum(dim=1)  # [K]
    drafted = torch.tensor(task.draft_tokens, dtype=torch.long, device=ids.device)[:, None]  # [K, 1]
    q_of_drafted = torch.where(ids == drafted, probs, torch.zeros_like(probs)).sum(dim=1)  # [K]
    return [
        (torch.isfinite(probs).all() & (probs >= 0).all(), lambda: "q has negative or non-finite probabilities"),
        (~((probs > 0) & ~in_vocab).any(),
         lambda: f"q gives probability to token ids outside the vocabulary [0, {vocab_size})"),
        (((sums - 1).abs() <= _SUM_TOLERANCE).all(),
         lambda: f"q rows must sum to 1, got sums {[round(float(s), 6) for s in sums[:5]]}"),
        ((q_of_drafted > 0).all(),
         lambda: f"draft tokens at positions {(q_of_drafted <= 0).nonzero().flatten().tolist()[:5]} have "
                 "probability 0 under the q sent with them"),
    ]


def _first_failure(checks: list[tuple[torch.Tensor, Callable[[], str]]]) -> str:
    return next(reason() for flag, reason in checks if not bool(flag))
