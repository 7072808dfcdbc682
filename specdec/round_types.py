"""Messages of one speculation round, shared by the coordinator and both workers.

These are the in-process forms; the gRPC layer maps them 1:1 onto protobuf messages. They carry
token ids and probabilities only, never model internals, so the coordinator stays model-free and
the two workers never need to know each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.params import SamplingParams
from specdec.sampling.tree import depths_and_ranks


@dataclass
class SparseDist:
    """A proposal distribution q over the vocabulary for each of k draft positions, stored sparsely.

    Row i is q_i: probs[i, j] is the probability of token token_ids[i, j]; padding entries have
    probability 0. The draft samples its token from exactly this distribution, so sending it
    sparse loses nothing.
    """

    token_ids: torch.Tensor  # [k, n] int64
    probs: torch.Tensor  # [k, n] float32, rows sum to 1

    @property
    def num_positions(self) -> int:
        return int(self.token_ids.shape[0])

    def to_dense(self, vocab_size: int) -> torch.Tensor:
        dense = torch.zeros(self.num_positions, vocab_size, dtype=torch.float32, device=self.token_ids.device)
        dense.scatter_add_(1, self.token_ids.long(), self.probs.float())
        return dense

    @staticmethod
    def from_dense(dense: torch.Tensor) -> SparseDist:
        """Keep the non-zero entries of each row (rows padded to the widest one)."""
        dense = dense.float()
        width = max(1, int((dense > 0).sum(dim=-1).max().item())) if dense.numel() else 1
        probs, ids = torch.topk(dense, k=width, dim=-1)
        return SparseDist(token_ids=ids, probs=probs)


@dataclass
class DraftTask:
    """Ask the draft for up to num_speculative_tokens tokens for one sequence.

    new_tokens: the tokens committed since this sequence's last round (the whole prompt on its
    first round). The draft appends them to its own copy of the sequence, rolls its KV cache back
    to the longest prefix it still agrees with, and catches up.
    assumed_tokens: tokens not committed (yet) that the draft should take as context after the
    committed ones, without recording them: a pre-draft (overlapped drafting) assumes the proposal
    under verification is accepted. The next task's new_tokens continue the committed tokens, so
    a wrong assumption costs only the cache entries, which roll back like any stale guess.
    """

    req_id: str
    new_tokens: list[int]
    num_speculative_tokens: int
    params: SamplingParams
    assumed_tokens: list[int] = field(default_factory=list)
    # More than 1: a token tree, this many children of the root, each continued as a chain: the
    # first num_speculative_tokens deep, the others side_depth deep (0: as deep as the first). A
    # drafter that cannot, or a request that should not, gets a chain.
    branches: int = 1
    side_depth: int = 0


@dataclass
class DraftProposal:
    req_id: str
    tokens: list[int]  # at most num_speculative_tokens (an n-gram drafter may find fewer, or none)
    q: SparseDist | None  # None for greedy requests; else one row per proposed token
    draft_forward_passes: int = 0
    # A token tree: tokens in depth-first order, parents[i] the node token i follows (-1: the last
    # committed token), q row i the distribution token i was drawn from. Empty: a chain.
    parents: list[int] = field(default_factory=list)

    @property
    def depth(self) -> int:
        """The tokens of its longest path: a chain's length, a tree's deepest node's depth."""
        return max(depths_and_ranks(self.parents)[0]) if self.parents else len(self.tokens)


@dataclass
class VerifyTask:
    """Verify one sequence's draft tokens.

    new_tokens: the prompt on the sequence's first round, empty afterwards (the target produced
    every later committed token itself).
    """

    req_id: str
    new_tokens: list[int]
    draft_tokens: list[int]
    q: SparseDist | None
    params: SamplingParams
    parents: list[int] = field(default_factory=list)  # a token tree, as DraftProposal's; empty: a chain


@dataclass
class VerifyOutcome:
    req_id: str
    num_accepted: int  # how many draft tokens were kept (of a tree: the accepted path's length)
    tokens: list[int]  # committed this round: the kept draft tokens + one correction/bonus token
    error: str = ""  # non-empty: the proposal was rejected unverified (tokens empty), and why


@dataclass
class VerifyResult:
    outcomes: list[VerifyOutcome]
    kv_blocks_used: int
    kv_blocks_total: int


@dataclass
class TargetInfo:
    """What the coordinator may know of the target: limits, not internals."""

    vocab_size: int
    max_seq_len: int
    eos_token_ids: list[int]
    kv_block_size: int
    kv_blocks_total: int
    model_name: str = ""
    num_parameters: int = 0  # the target's, to price a draft step before anything is measured


@dataclass
class DraftInfo:
    kind: str  # "model" | "ngram" (specdec.config.NGRAM)
    vocab_size: int | None = None
    max_seq_len: int | None = None
    extra: dict = field(default_factory=dict)
