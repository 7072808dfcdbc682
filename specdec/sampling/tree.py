"""Verifying a tree of draft tokens (SpecInfer's multi-step speculative sampling), one sequence.

Terms. The draft proposed a prefix tree of N nodes, in depth-first order: node i holds token
tokens[i], hangs under parents[i] (-1: under the root, the last committed token) and was drawn
from q[i] (siblings drawn i.i.d. share it); a chain is the tree where every node has at most one
child. The target scored every node in one pass: p[i] is its distribution for the token after
node i, p_root the one after the root.

The walk. At a node, try its children in their order; child c is accepted with probability
min(1, r(c) / q[c](c)), where r starts as the node's p; after a rejection r becomes
norm(max(0, r - q[c])). An accepted child becomes the node; when every child is rejected, or the
node has none (the bonus), the next token is sampled from r and the walk ends. Each try is the
chain's rule aimed at r with proposal q, so its outcome (c, or a sample of the residual) is
distributed as r; the residual is what the later tries and the final sample then aim at. The
committed tokens are distributed exactly as the target's whenever each child, given the children
tried before it, is distributed as its own q[c]: children drawn independently (SpecInfer, Miao et
al. 2024, Theorem 4.2), and children drawn without replacement with q[c] the node's distribution
less the earlier children, renormalised (Sequoia's rule, Chen et al. 2024). Greedy: the child
equal to the argmax of p, if any, is accepted; then the argmax is the next token.

Randomness is explicit: u_accept[i] is the uniform of node i's accept test, u_next[d] the
uniform of the final sample when the walk ends at depth d (after d accepted nodes).
"""
from __future__ import annotations

import torch

from specdec.sampling.speculative import sample_from_probs


def tree_verify(
    p_root: torch.Tensor,  # [V] target probs after the root
    p: torch.Tensor,  # [N, V] target probs after each node
    q: torch.Tensor | None,  # [N, V] the distribution node i was drawn from (None when greedy)
    tokens: list[int],  # [N] draft token of each node, depth-first order
    parents: list[int],  # [N] parent node of each node, -1 for the root
    greedy: bool,
    u_accept: torch.Tensor | None,  # [N] float64 uniform of each node's accept test; None when greedy
    u_next: torch.Tensor | None,  # [depth + 1] float64 final-sample uniform by the depth reached; None when greedy
) -> tuple[list[int], int]:
    """-> (accepted nodes from the root down, next token). Greedy reads only the argmax of each
    row, so p may then be the logits themselves."""
    if greedy:
        return greedy_tree_walk([int(p_root.argmax()), *p.argmax(dim=-1).tolist()], tokens, parents)
    path: list[int] = []
    node = -1
    while True:
        r = p_root if node < 0 else p[node]
        children = [i for i, parent in enumerate(parents) if parent == node]
        child, r = _try_children(r.double(), q, children, tokens, u_accept)
        if child is None:  # r: the node's p (no children, the bonus) or the last residual
            break
        path.append(child)
        node = child
    return path, int(sample_from_probs(r[None], u_next[len(path)][None])[0])


def greedy_tree_walk(argmax: list[int], tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """The greedy walk on the target's argmax after the root (argmax[0]) and after each node
    (argmax[1 + i]): follow the child that is the argmax while there is one; the argmax then."""
    path: list[int] = []
    node = -1
    while True:
        best = argmax[node + 1]
        child = next((c for c in range(node + 1, len(parents)) if parents[c] == node and tokens[c] == best), None)
        if child is None:
            return path, best
        path.append(child)
        node = child


def _try_children(r: torch.Tensor, q: torch.Tensor, children: list[int], tokens: list[int], u_accept: torch.Tensor
                  ) -> tuple[int | None, torch.Tensor]:
    """(the accepted child or None, the distribution the next token is then drawn from)."""
    for child in children:
        token, proposal = tokens[child], q[child].double()
        # u < min(1, r/q) without a division, as in the chain's rule.
        if r[token] > 0 and (r[token] >= proposal[token] or u_accept[child] * proposal[token] < r[token]):
            return child, r
        r = residual_after_rejection(r, proposal)
    return None, r


def residual_after_rejection(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, r - q)) [V]; r itself where r == q (a rejection there had probability ~0)."""
    residual = (r - q).clamp_min(0)
    total = residual.sum()
    return residual / total if total > 0 else r


def side_branch_depth(depth: int, side_depth: int) -> int:
    """How deep the root's children after the first grow when the first grows `depth` deep:
    side_depth, at most `depth` (0: as deep as the first)."""
    return min(depth, side_depth) if side_depth else depth


def tree_size(depth: int, branches: int, side_depth: int) -> int:
    """Nodes of a tree of `branches` children of the root, the first grown `depth` deep and the
    others side_branch_depth deep: what a round of that shape verifies."""
    return depth + (branches - 1) * side_branch_depth(depth, side_depth)


def leading_chain(parents: list[int]) -> int:
    """How many of the first nodes form a chain from the root (each follows the one before it):
    fed after the prefix they see exactly what causal tokens see."""
    return next((i for i, parent in enumerate(parents) if parent != i - 1), len(parents))


def is_chain(parents: list[int]) -> bool:
    """Whether the tree `parents` describes is a chain (each node follows the one before it)."""
    return leading_chain(parents) == len(parents)


def depths_and_ranks(parents: list[int]) -> tuple[list[int], list[int]]:
    """Each node's depth (1: a child of the root) and rank among the nodes of its depth in
    depth-first order (0 for every node of a chain): the rank picks a node's uniforms."""
    depths, ranks, seen = [], [], {}
    for parent in parents:
        depth = 1 if parent < 0 else depths[parent] + 1
        ranks.append(seen.get(depth, 0))
        seen[depth] = ranks[-1] + 1
        depths.append(depth)
    return depths, ranks


def chains_parents(lengths: list[int]) -> list[int]:
    """The parents of a tree of chains (branch j has lengths[j] nodes) in depth-first order: each
    branch's first node under the root, each later one under the node before it."""
    parents: list[int] = []
    for length in lengths:
        parents += [-1] + list(range(len(parents), len(parents) + length - 1))
    return parents


def node_paths(parents: list[int], start: int) -> list[list[int]]:
    """Each node's path as cache indices (its ancestors', then its own), nodes stored from `start`
    in depth-first order."""
    paths: list[list[int]] = []
    for i, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else []) + [start + i])
    return paths


# The most nodes a tree may have: 16 branches of the longest chain a request may ask for (64). A
# pass gives each node a row of key slots as long as the context, so the bound keeps that finite.
MAX_TREE_NODES = 16 * 64


def tree_problem(parents: list[int], num_tokens: int) -> str | None:
    """Why `parents` is not a tree of num_tokens nodes in depth-first order, or None."""
    if num_tokens > MAX_TREE_NODES:
        return f"a tree may have at most {MAX_TREE_NODES} nodes, got {num_tokens}"
    if len(parents) != num_tokens:
        return f"a tree of {num_tokens} tokens needs {num_tokens} parents, got {len(parents)}"
    if any(not -1 <= parent < i for i, parent in enumerate(parents)):
        return "each node's parent must come before it (depth-first order) or be -1 (the last committed token)"
    return None
