"""A draft token tree grown a depth per draft step: `branches` children of the root, each continued
as a chain (specdec.sampling.tree: a chain is the tree of width 1).

The root's children are drawn from one distribution: i.i.d. for a sampled request (each with its
own rank's uniform, so each is a draw from the q sent with it), the top `branches` tokens for a
greedy one (greedy acceptance compares tokens, so any children are fine). From then on each
branch's leaf is fed in one pass with the others, attending to its own path only
(model.batch.TreeNodes), and picks the branch's next token. The nodes fed stay in the draft's cache
after the round (DraftedTree); the next round keeps the path the target accepted, moved into place.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.model.batch import TreeNodes


@dataclass
class DraftedTree:
    """The tree nodes in the draft's cache after its committed prefix, in the order they were fed."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # index into tokens; -1: under the prefix

    def accepted_path(self, following: list[int]) -> list[int]:
        """The longest path of nodes whose tokens are `following`'s first ones (cache order)."""
        path, node = [], -1
        for token in following:
            child = next((c for c, parent in enumerate(self.parents) if parent == node and self.tokens[c] == token),
                         None)
            if child is None:
                break
            path.append(child)
            node = child
        return path


class TreeGrowth:
    """One request's tree while it is drafted: its branches' tokens, q rows and cache paths."""

    def __init__(self, branches: int, start: int):
        self.branches = branches
        self.start = start  # the cache index of the first node fed
        self.tokens: list[list[int]] = [[] for _ in range(branches)]
        self.q_rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(branches)]
        self.paths: list[list[int]] = [[] for _ in range(branches)]  # cache indices of each branch's fed nodes
        self.cached = DraftedTree()

    def leaves(self, cache_length: int) -> tuple[list[int], TreeNodes]:
        """Feed each branch's last token (at cache_length + j): (the tokens, their tree)."""
        for j, path in enumerate(self.paths):
            self.cached.parents.append(len(self.cached.tokens) - self.branches if path else -1)
            self.cached.tokens.append(self.tokens[j][-1])
            path.append(cache_length + j)
        return [branch[-1] for branch in self.tokens], TreeNodes(self.start, [list(p) for p in self.paths])

    def add(self, tokens: list[int], q_rows: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        for j, (token, q) in enumerate(zip(tokens, q_rows)):
            self.tokens[j].append(token)
            if q is not None:
                self.q_rows[j].append(q)

    def proposal(self) -> tuple[list[int], list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
        """(tokens, parents, q rows) in depth-first order: branch 0's chain, then branch 1's, ..."""
        tokens, parents, rows = [], [], []
        for branch, q in zip(self.tokens, self.q_rows):
            parents += [-1] + list(range(len(tokens), len(tokens) + len(branch) - 1))
            tokens += branch
            rows += q
        return tokens, parents, rows
