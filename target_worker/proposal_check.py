"""The target does not trust the draft worker: a proposal is checked before it is verified.

A faulty or hostile drafter could otherwise push tokens into the output: a token proposed with
q = 0 passes `u * q < p` whenever p > 0, and a q that is not a distribution breaks the accept
test's arithmetic. A proposal that fails these checks fails its own request, with the reason;
the other requests of the round go on.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from specdec.round_types import VerifyTask
from specdec.sampling.tree import tree_problem

# float32 rows of at most a few hundred entries sum to 1 within ~1e-6 when they were normalised.
_SUM_TOLERANCE = 1e-4
# A check: a 0-d bool, True where it passes (on q's device, or numpy's on the host), and its reason.
Check = tuple[torch.Tensor | np.bool_, Callable[[], str]]


def proposal_problems(tasks: list[VerifyTask], vocab_size: int) -> dict[str, str]:
    """Why each task that cannot be verified cannot be, by request id. The q checks of the whole
    round read one flag per task back from q's device at once (one host sync, not one per check
    and task); a failed task's reason is then worked out on its own."""
    problems = {t.req_id: why for t in tasks if (why := _host_problem(t, vocab_size))}
    checked = [t for t in tasks if t.req_id not in problems and _needs_q(t)]
    if checked:
        device = checked[0].q.probs.device
        on_host = device.type == "cpu"
        checks = [_q_checks(t, vocab_size, on_host) for t in checked]
        if on_host:  # (numpy's flags: no sync to save)
            flags = [all(bool(flag) for flag, _ in c) for c in checks]
        else:
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


def _q_checks(task: VerifyTask, vocab_size: int, on_host: bool) -> list[Check]:
    """Each check of q, in order: (a 0-d bool, True where it passes: on q's device, no host sync;
    the reason, worked out only for a check that fails). on_host (q on the CPU): in numpy, with
    the same verdicts (torch's fixed cost per call made these ~0.25 ms of a sampled batch-1 round)."""
    q = task.q
    if on_host:
        xp, ids, probs = np, q.token_ids.numpy(), q.probs.numpy().astype(np.float64)  # [K, n] each
        drafted = np.asarray(task.draft_tokens)[:, None]  # [K, 1]
    else:
        xp, ids, probs = torch, q.token_ids.long(), q.probs.double()
        drafted = torch.tensor(task.draft_tokens, dtype=torch.long, device=ids.device)[:, None]
    in_vocab = (ids >= 0) & (ids < vocab_size)
    sums = probs.sum(1)  # [K]
    q_of_drafted = xp.where(ids == drafted, probs, 0.0).sum(1)  # [K]
    return [
        (xp.isfinite(probs).all() & (probs >= 0).all(), lambda: "q has negative or non-finite probabilities"),
        (~((probs > 0) & ~in_vocab).any(),
         lambda: f"q gives probability to token ids outside the vocabulary [0, {vocab_size})"),
        ((abs(sums - 1) <= _SUM_TOLERANCE).all(),
         lambda: f"q rows must sum to 1, got sums {[round(float(s), 6) for s in sums[:5]]}"),
        ((q_of_drafted > 0).all(),
         lambda: f"draft tokens at positions {[i for i, p in enumerate(q_of_drafted.tolist()) if p <= 0][:5]} "
                 "have probability 0 under the q sent with them"),
    ]


def _first_failure(checks: list[Check]) -> str:
    return next(reason() for flag, reason in checks if not bool(flag))
