"""The target does not trust the draft worker: a proposal is checked before it is verified.

A faulty or hostile drafter could otherwise push tokens into the output: a token proposed with
q = 0 passes `u * q < p` whenever p > 0, and a q that is not a distribution breaks the accept
test's arithmetic. A proposal that fails these checks fails its own request, with the reason;
the other requests of the round go on.
"""
from __future__ import annotations

import torch

from specdec.round_types import VerifyTask

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
        flags = torch.stack([_q_is_valid(t, vocab_size).to(device) for t in checked]).tolist()
        problems.update({t.req_id: _q_problem(t, vocab_size) or "q failed its checks" for t, ok in zip(checked, flags)
                     if not ok})
    return problems


def _needs_q(task: VerifyTask) -> bool:
    return not task.params.greedy and bool(task.draft_tokens)  # greedy verification compares tokens


def _host_problem(task: VerifyTask, vocab_size: int) -> str | None:
    bad = [t for t in task.draft_tokens if not 0 <= t < vocab_size]
    if bad:
        return f"draft token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
    q = task.q
    if _needs_q(task) and (q is None or q.num_positions != len(task.draft_tokens)):
        rows = 0 if q is None else q.num_positions
        return f"a sampled request needs q for each of its {len(task.draft_tokens)} draft tokens, got {rows}"
    return None


def _q_of_drafted(task: VerifyTask, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    drafted = torch.tensor(task.draft_tokens, dtype=torch.long, device=ids.device)[:, None]  # [K, 1]
    return torch.where(ids == drafted, probs, torch.zeros_like(probs)).sum(dim=1)  # [K]


def _q_is_valid(task: VerifyTask, vocab_size: int) -> torch.Tensor:
    """0-d bool on q's device: every check of _q_problem passes (no host sync)."""
    ids, probs = task.q.token_ids.long(), task.q.probs.double()  # [K, n] each
    finite = torch.isfinite(probs).all() & (probs >= 0).all()
    in_vocab = ~((probs > 0) & ((ids < 0) | (ids >= vocab_size))).any()
    normalised = ((probs.sum(dim=1) - 1).abs() <= _SUM_TOLERANCE).all()
    return finite & in_vocab & normalised & (_q_of_drafted(task, ids, probs) > 0).all()


def _q_problem(task: VerifyTask, vocab_size: int) -> str | None:
    ids, probs = task.q.token_ids.long(), task.q.probs.double()
    if not torch.isfinite(probs).all() or (probs < 0).any():
        return "q has negative or non-finite probabilities"
    if ((probs > 0) & ((ids < 0) | (ids >= vocab_size))).any():
        return f"q gives probability to token ids outside the vocabulary [0, {vocab_size})"
    sums = probs.sum(dim=1)
    if ((sums - 1).abs() > _SUM_TOLERANCE).any():
        return f"q rows must sum to 1, got sums {[round(float(s), 6) for s in sums[:5]]}"
    outside = (_q_of_drafted(task, ids, probs) <= 0).nonzero().flatten().tolist()
    if outside:
        return f"draft tokens at positions {outside[:5]} have probability 0 under the q sent with them"
    return None
