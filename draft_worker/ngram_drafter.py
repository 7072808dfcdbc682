"""Prompt-lookup drafting: no model, propose what followed the last occurrence of the current suffix.

Code and chat repeat themselves (identifiers, boilerplate, quoted context), so the tokens that
followed an earlier occurrence of the last n tokens are often what comes next. For sampled
requests the proposal is deterministic, so q is one-hot at the proposed token: acceptance is then
p(t) and the residual is p with t removed, which keeps the output exactly the target's.
"""
from __future__ import annotations

import numpy as np
import torch

from draft_worker.drafter import Drafter
from specdec.config import NGRAM
from specdec.round_types import DraftInfo, DraftProposal, DraftTask, SparseDist
from specdec.sampling.tree import chains_parents, side_branch_depth


def lookup_continuation(tokens: list[int], max_tokens: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to max_tokens tokens that followed the most recent earlier match of the longest suffix
    n-gram (max_ngram down to min_ngram)."""
    found = lookup_continuations(tokens, max_tokens, max_ngram, min_ngram, 1)
    return found[0] if found else []


def lookup_continuations(tokens: list[int], max_tokens: int, max_ngram: int, min_ngram: int,
                         branches: int) -> list[list[int]]:
    """Up to `branches` continuations (each up to max_tokens) with distinct first tokens: what
    followed the earlier matches of the longest suffix n-gram, most recent first, then those of
    shorter n-grams down to min_ngram (the most recent is the most relevant context).

    One vectorised pass, not a Python scan: the earlier occurrences of the last token are the
    candidates, and each step keeps those whose preceding token also matches, so the survivors of
    step n end an n-gram match. A 2048-token window costs tens of microseconds.
    """
    context = np.asarray(tokens, dtype=np.int64)
    length = len(context)
    ends = np.flatnonzero(context[:-1] == context[-1]) if length > 1 else context[:0]  # 1-gram matches
    levels = []  # the match ends of each n-gram length from min_ngram up
    n = 1
    while ends.size and n <= max_ngram:
        if n >= min_ngram:
            levels.append(ends)
        ends = ends[ends >= n]  # room for one more token before the match
        ends = ends[context[ends - n] == context[length - 1 - n]] if n < length - 1 else ends[:0]
        n += 1
    found, firsts = [], set()
    for ends in reversed(levels):
        for end in ends[::-1].tolist():
            if int(context[end + 1]) not in firsts:  # (a match ends before the last token: one follows)
                firsts.add(int(context[end + 1]))
                found.append(context[end + 1:end + 1 + max_tokens].tolist())
                if len(found) == branches:
                    return found
    return found


class NgramDrafter(Drafter):
    def __init__(self, max_ngram: int, min_ngram: int, window: int):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.window = window  # bound the scan so a long context cannot make a round slow
        self._tokens: dict[str, list[int]] = {}

    def info(self) -> DraftInfo:
        return DraftInfo(kind=NGRAM, extra={"max_ngram": self.max_ngram, "min_ngram": self.min_ngram})

    def propose(self, tasks: list[DraftTask]) -> list[DraftProposal]:
        proposals = []
        for task in tasks:
            tokens = self._tokens.setdefault(task.req_id, [])
            tokens.extend(task.new_tokens)
            context = tokens + task.assumed_tokens
            draft, parents = [], []
            if task.num_speculative_tokens > 0 and task.assumed_tokens:
                draft = self._predraft(context, task.num_speculative_tokens)
            elif task.num_speculative_tokens > 0:
                found = lookup_continuations(context[-self.window:], task.num_speculative_tokens, self.max_ngram,
                                             self.min_ngram, task.branches)
                side = side_branch_depth(task.num_speculative_tokens, task.side_depth)
                found = found[:1] + [branch[:side] for branch in found[1:]]
                draft = [token for branch in found for token in branch]
                if len(found) > 1:  # a tree of chains, depth-first, when several matches differ
                    parents = chains_parents([len(branch) for branch in found])
            q = None
            if draft and not task.params.greedy:
                # Each node is its own point mass: children drawn independently (trivially, as
                # they are not random), which the tree walk's rule allows per child.
                q = SparseDist(token_ids=torch.tensor(draft, dtype=torch.long)[:, None],
                               probs=torch.ones(len(draft), 1))
            proposals.append(DraftProposal(req_id=task.req_id, tokens=draft, q=q, draft_forward_passes=0,
                                           parents=parents))
        return proposals

    def _lookup(self, context: list[int], max_tokens: int) -> list[int]:
        return lookup_continuation(context[-self.window:], max_tokens, self.max_ngram, self.min_ngram)

    def _predraft(self, context: list[int], max_tokens: int) -> list[int]:
        """A pre-draft: a guess g of the target's next token, then exactly what a task on
        context + [g] would propose (a later lookup may match elsewhere than the first one did),
        so that a pre-draft kept after a correct guess is the serial proposal."""
        guess = self._lookup(context, 1)
        return guess + self._lookup(context + guess, max_tokens - 1) if guess and max_tokens > 1 else guess

    def release(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._tokens.pop(req_id, None)
