"""Verifying a tree of draft tokens (SpecInfer's multi-step speculative sampling), one sequence.

Terms. The draft proposed a prefix tree of N nodes, in depth-first order: node i holds token
tokens[i] and hangs under parents[i] (-1: under the root, the last committed token). A node's
children were drawn i.i.d. from one proposal distribution, q[i] for the children of node i and
q_root for the root's; a chain is the tree where every node has at most one child. The target
scored every node in one pass: p[i] is its distribution for the token after node i, p_root the
one after the root.

The walk. At a node, try its children in their order; child c is accepted with probability
min(1, r(c) / q(c)), where r starts as the node's p; after a rejection r becomes
norm(max(0, r - q)). An accepted child becomes the node; when every child is rejected, or the
node has none (the bonus), the next token is sampled from r and the walk ends. Each try is the
chain's rule aimed at r with proposal q, so its outcome (c, or a sample of the residual) is
distributed as r; the residual is what the later tries and the final sample then aim at. With the
children drawn independently of each other, the committed tokens are distributed exactly as the
target's (SpecInfer, Miao et al. 2024, Theorem 4.2). Children drawn without replacement (top-b)
need another rule (SpecTr, Sequoia) and are not handled here. Greedy: the child equal to the
argmax of p, if any, is accepted; then the argmax is the next token.

Randomness is explicit: u_accept[i] is the uniform of node i's accept test, u_next[j] the
uniform of the final sample when the walk ends at node j (j = N: the root).
"""
from __future__ import annotations

import torch

from specdec.sampling.speculative import sample_from_probs


def tree_verify(
    p_root: torch.Tensor,  # [V] target probs after the root
    p: torch.Tensor,  # [N, V] target probs after each node
    q_root: torch.Tensor,  # [V] the distribution the root's children were drawn from
    q: torch.Tensor,  # [N, V] the distribution node i's children were drawn from (unused for leaves)
    tokens: list[int],  # [N] draft token of each node, depth-first order
    parents: list[int],  # [N] parent node of each node, -1 for the root
    greedy: bool,
    u_accept: torch.Tensor,  # [N] float64 uniform of each node's accept test
    u_next: torch.Tensor,  # [N + 1] float64 uniform of the final sample, by the node the walk ends at
) -> tuple[list[int], int]:
    """-> (accepted nodes from the root down, next token)."""
    path: list[int] = []
    node = -1
    while True:
        r = (p_root if node < 0 else p[node]).double()
        proposal = (q_root if node < 0 else q[node]).double()
        children = [i for i, parent in enumerate(parents) if parent == node]
        child, r = _try_children(r, proposal, children, tokens, greedy, u_accept)
        if child is None:  # r: the node's p (no children, the bonus) or the last residual
            break
        path.append(child)
        node = child
    if greedy:
        return path, int(r.argmax())
    return path, int(sample_from_probs(r[None], u_next[node][None])[0])


def _try_children(r: torch.Tensor, q: torch.Tensor, children: list[int], tokens: list[int], greedy: bool,
                  u_accept: torch.Tensor) -> tuple[int | None, torch.Tensor]:
    """(the accepted child or None, the distribution the next token is then drawn from)."""
    if greedy:
        best = int(r.argmax())
        return next((c for c in children if tokens[c] == best), None), r
    for child in children:
        token = tokens[child]
        # u < min(1, r/q) without a division, as in the chain's rule.
        if r[token] > 0 and (r[token] >= q[token] or u_accept[child] * q[token] < r[token]):
            return child, r
        r = residual_after_rejection(r, q)
    return None, r


def residual_after_rejection(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, r - q)) [V]; r itself where r == q (a rejection there had probability ~0)."""
    residual = (r - q).clamp_min(0)
    total = residual.sum()
    return residual / total if total > 0 else r
