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


def proposal_problem(task: VerifyTask, vocab_size: int) -> str | None:
    """Why the draft tokens and q of `task` cannot be verified, or None if they can."""
    bad = [t for t in task.draft_tokens if not 0 <= t < vocab_size]
    if bad:
        return f"draft token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
    if task.params.greedy or not task.draft_tokens:
        return None  # greedy verification compares tokens; q plays no part
    q = task.q
    if q is None or q.num_positions != len(task.draft_tokens):
        rows = 0 if q is None else q.num_positions
        return f"a sampled request needs q for each of its {len(task.draft_tokens)} draft tokens, got {rows}"
    ids, probs = q.token_ids.long(), q.probs.double()
    if not torch.isfinite(probs).all() or (probs < 0).any():
        return "q has negative or non-finite probabilities"
    if ((probs > 0) & ((ids < 0) | (ids >= vocab_size))).any():
        return f"q gives probability to token ids outside the vocabulary [0, {vocab_size})"
    sums = probs.sum(dim=1)
    if ((sums - 1).abs() > _SUM_TOLERANCE).any():
        return f"q rows must sum to 1, got sums {[round(float(s), 6) for s in sums[:5]]}"
    drafted = torch.tensor(task.draft_tokens, dtype=torch.long, device=ids.device)[:, None]
    q_of_token = torch.where(ids == drafted, probs, torch.zeros_like(probs)).sum(dim=1)
    outside = (q_of_token <= 0).nonzero().flatten().tolist()
    if outside:
        return f"draft tokens at positions {outside[:5]} have probability 0 under the q sent with them"
    return None
