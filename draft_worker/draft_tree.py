"""A draft token tree grown a depth per draft step: `branches` children of the root, each continued
as a chain, the first K deep and the others side_depth deep (specdec.sampling.tree: a chain is the
tree of width 1).

The root's children: for a sampled request, drawn from q without replacement (distinct_children),
each sent with the distribution it was drawn from, so the target's walk tests it against exactly
that; for a greedy one, the top `branches` tokens (greedy acceptance compares tokens, so any
children are fine). From then on each branch's leaf is fed in one pass with the others, attending
to its own path only (model.batch.TreeNodes), and picks the branch's next token; where the other
branches are leaves, the first grows as a chain (add_chain). The nodes fed stay in the draft's
cache after the round (DraftedTree); the next round keeps the path the target accepted, moved into
place.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specdec.model.batch import TreeNodes
from specdec.sampling import DRAFT, sample_from_probs, stream_key, uniforms
from specdec.sampling.tree import chains_parents, side_branch_depth

QRow = tuple[torch.Tensor, torch.Tensor]  # a sparse distribution: ids [n], probs [n]


def distinct_children(first: int, q: QRow, count: int, seed: int | None, position: int, kernels=None
                      ) -> tuple[list[int], list[QRow]]:
    """Up to `count` distinct children of one node, drawn from q without replacement: `first` (drawn
    from q itself with the rank-0 uniform: the chain's token), then child j from q with the earlier
    children removed and renormalised, with the rank-j DRAFT uniform at `position`. Each comes with
    the distribution it was drawn from: the walk's rule (try each child against its own q, the
    residual after each rejection) is then Sequoia's for sampling without replacement, exact because
    each child, given the ones before, is distributed as its q. Fewer children where q has fewer
    tokens. An i.i.d. second draw repeats the first child as often as q favours it, and a repeat of
    a rejected token is always rejected: distinct children are what a tree's width is for.

    In the model's C kernels (`kernels`) for a float32 q on the CPU, else in numpy, the same bits:
    the float64 total summed in order, each entry divided in float64, then float32 (between the
    draft's passes torch's small ops ran cold, ~0.4 ms a tree, numpy's ~0.3)."""
    ids, probs = q
    if count < 2:
        return [first], [q]
    if kernels is not None and ids.device.type == "cpu" and probs.dtype == torch.float32:
        keys = [stream_key(seed, DRAFT, rank) for rank in range(count)]
        tokens, rows = kernels.distinct_children(ids.contiguous(), probs.contiguous(), first, count, keys, position)
        return tokens, [q, *((ids, row) for row in rows[1:len(tokens)])]
    tokens, found = [first], [q]
    host_ids, left = ids.cpu().numpy(), probs.cpu().numpy()
    for rank in range(1, count):
        left = np.where(host_ids == tokens[-1], np.float32(0.0), left)  # (the earlier children: 0 already)
        total = np.add.accumulate(left, dtype=np.float64)[-1]
        if not total > 0.0:
            break
        left = (left.astype(np.float64) / total).astype(np.float32)
        u = uniforms([seed], [position], DRAFT, None, [rank])
        pick = int(sample_from_probs(torch.from_numpy(left)[None], u)[0])
        tokens.append(int(host_ids[pick]))
        found.append((ids, torch.from_numpy(left).to(probs.device)))
    return tokens, found


def greedy_children(first: int, top: list[int], count: int) -> tuple[list[int], list[None]]:
    """A greedy request's `count` children of one node: `first` (its argmax: the chain's token),
    then the other `top` tokens (largest first); greedy acceptance compares tokens, no q."""
    children = [first, *(token for token in top if token != first)][:count]
    return children, [None] * len(children)


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

    def __init__(self, branches: int, start: int, depth: int, side_depth: int):
        self.branches = branches  # asked for; the root's children may be fewer (add_root)
        self.start = start  # the cache index of the first node fed
        self.depths = [depth] + [side_branch_depth(depth, side_depth)] * (branches - 1)
        self.tokens: list[list[int]] = []
        self.q_rows: list[list[QRow]] = []
        self.paths: list[list[int]] = []  # cache indices of each branch's fed nodes (start + their index in cached)
        self.growing: list[int] = []  # the branches fed in this step: they take its next tokens
        self.cached = DraftedTree()

    def add_root(self, tokens: list[int], q_rows: list[QRow | None]) -> None:
        """The root's children: one branch each."""
        self.branches, self.depths = len(tokens), self.depths[:len(tokens)]
        self.tokens = [[token] for token in tokens]
        self.q_rows = [[q] if q is not None else [] for q in q_rows]
        self.paths = [[] for _ in tokens]

    def grows_as_chain(self) -> bool:
        """Whether only the first branch grows past the root's children (the others are leaves):
        its nodes are then fed as a chain on the prefix, in one call (ModelRunner.draft_chain)."""
        return all(depth <= 1 for depth in self.depths[1:])

    def add_chain(self, picks: list[int], q_rows: list[QRow]) -> None:
        """The first branch grown as a chain right after add_root: its first token, then each pick
        but the last, fed after the prefix; the picks continue the branch."""
        fed = [self.tokens[0][-1], *picks[:-1]] if picks else []
        self.cached = DraftedTree(fed, list(range(-1, len(fed) - 1)))
        self.tokens[0] += picks
        self.q_rows[0] += q_rows

    def leaves(self, cache_length: int) -> tuple[list[int], TreeNodes | None]:
        """Feed the last token of each branch still growing (the k-th at cache_length + k): (the
        tokens, their tree; None when one branch alone grows on the prefix, which is a chain)."""
        self.growing = [j for j, branch in enumerate(self.tokens) if len(branch) < self.depths[j]]
        for k, j in enumerate(self.growing):
            self.cached.parents.append(self.paths[j][-1] - self.start if self.paths[j] else -1)
            self.cached.tokens.append(self.tokens[j][-1])
            self.paths[j].append(cache_length + k)
        paths = [list(self.paths[j]) for j in self.growing]
        chain = len(paths) == 1 and paths[0] == list(range(self.start, self.start + len(paths[0])))
        return [self.tokens[j][-1] for j in self.growing], None if chain else TreeNodes(self.start, paths)

    def add(self, tokens: list[int], q_rows: list[QRow | None]) -> None:
        """The next token of each branch fed in this step."""
        for j, token, q in zip(self.growing, tokens, q_rows):
            self.tokens[j].append(token)
            if q is not None:
                self.q_rows[j].append(q)

    def proposal(self) -> tuple[list[int], list[int], list[QRow]]:
        """(tokens, parents, q rows) in depth-first order: branch 0's chain, then branch 1's, ..."""
        tokens = [token for branch in self.tokens for token in branch]
        rows = [q for branch in self.q_rows for q in branch]
        return tokens, chains_parents([len(branch) for branch in self.tokens]), rows
