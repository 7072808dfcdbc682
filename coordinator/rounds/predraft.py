"""Pre-drafts: proposals for round r+1 drafted while the target verifies round r (overlap).

Terms:
- pre-draft: a draft task sent beside round r's verify call. It assumes the proposal d1..dk under
  verification is accepted (`DraftTask.assumed_tokens`) and asks for 1 + n tokens: g, the draft's
  guess of the target's bonus token, then n tokens drafted after g.
- hit: round r committed exactly d1..dk, g. The n tokens after g were then drafted from exactly
  the committed context, at the same positions, with the same position-keyed random draws
  (specdec.sampling.random) as a task sent after the verdict: they *are* round r+1's serial
  proposal (its first n tokens), so using them changes nothing about the output.
- miss: anything else (a rejection, a different bonus token, a stop); the pre-draft is dropped
  and the draft rolls its cache back to the committed tokens on its next task.

Only the coordinator decides hit or miss: it holds the committed tokens, and the draft never
records assumed tokens as committed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.round_types import DraftProposal, SparseDist


@dataclass
class PreDraft:
    expected: list[int]  # what round r must commit for a hit: d1..dk and the guess g
    after: DraftProposal  # the tokens drafted after g, with their q rows (None for greedy)
    asked: int  # tokens asked for after g: a proposal of up to this K is served whole
    length: int  # the sequence's length once `expected` is committed: where `after` starts

    @staticmethod
    def split(assumed: list[int], asked: int, proposal: DraftProposal, length: int) -> PreDraft | None:
        """From a pre-draft's reply (`length`: the sequence's committed length when it was sent);
        None when the draft made no guess (an n-gram miss)."""
        if not proposal.tokens:
            return None
        q = proposal.q
        after_q = None if q is None else SparseDist(token_ids=q.token_ids[1:], probs=q.probs[1:])
        after = DraftProposal(req_id=proposal.req_id, tokens=proposal.tokens[1:], q=after_q,
                              draft_forward_passes=proposal.draft_forward_passes)
        return PreDraft(expected=assumed + proposal.tokens[:1], after=after, asked=asked - 1,
                        length=length + len(assumed) + 1)

    def complete_for(self, k: int) -> bool:
        """Does this pre-draft hold the whole proposal of a round that asks for k tokens? Also
        when it came back shorter than asked: a drafter that stops early (n-gram) would stop
        there again on the same context."""
        return k <= self.asked or len(self.after.tokens) < self.asked

    def take(self, k: int) -> DraftProposal:
        """The first k tokens (and q rows): a prefix of a proposal is the shorter proposal, as
        every token was drafted from the ones before it only."""
        q = self.after.q
        return DraftProposal(req_id=self.after.req_id, tokens=self.after.tokens[:k],
                             q=None if q is None else SparseDist(token_ids=q.token_ids[:k], probs=q.probs[:k]),
                             draft_forward_passes=0)


def concat_proposals(head: DraftProposal, tail: DraftProposal) -> DraftProposal:
    """head's tokens then tail's (drafted with head's tokens assumed); q rows padded to one width
    with zero-probability entries (ids unused in their row, so no token is listed twice)."""
    q = None
    if head.q is not None and tail.q is not None:
        width = max(head.q.token_ids.shape[1], tail.q.token_ids.shape[1])
        q = SparseDist(token_ids=torch.cat([_pad_ids(head.q.token_ids, width), _pad_ids(tail.q.token_ids, width)]),
                       probs=torch.cat([_pad_probs(head.q.probs, width), _pad_probs(tail.q.probs, width)]))
    else:
        q = head.q if tail.q is None else tail.q
    return DraftProposal(req_id=head.req_id, tokens=head.tokens + tail.tokens, q=q,
                         draft_forward_passes=head.draft_forward_passes + tail.draft_forward_passes)


def _pad_probs(probs: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(probs, (0, width - probs.shape[1]))


def _pad_ids(ids: torch.Tensor, width: int) -> torch.Tensor:
    """Pad each row with ids it does not use: the smallest non-negative integers absent from it."""
    extra = width - ids.shape[1]
    if extra == 0:
        return ids
    rows = []
    for row in ids.tolist():
        used, fill, candidate = set(row), [], 0
        while len(fill) < extra:
            if candidate not in used:
                fill.append(candidate)
            candidate += 1
        rows.append(row + fill)
    return torch.tensor(rows, dtype=ids.dtype, device=ids.device)
