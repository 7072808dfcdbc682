"""specdec.sampling.tree: a token tree verified by SpecInfer's rule commits tokens distributed as
the target's, for children drawn i.i.d. from the draft; a chain is verified exactly as the chain's
rule does; greedy takes the target's argmax path. A wrong residual update must fail the same
chi-square test (the negative control)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.sampling import tree as tree_module
from specdec.sampling.speculative import speculative_verify
from specdec.sampling.tree import MAX_TREE_NODES, depths_and_ranks, tree_problem, tree_size, tree_verify

V = 5
P_MIN = 1e-3  # chi-square p-value threshold; seeds are fixed, so the tests are deterministic


def dist(gen: torch.Generator, *shape) -> torch.Tensor:
    x = torch.rand(*shape, V, generator=gen, dtype=torch.float64) ** 3 + 1e-3
    return x / x.sum(dim=-1, keepdim=True)


def test_a_chain_is_verified_as_the_chain_rule_verifies_it():
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        k = int(torch.randint(1, 4, (1,), generator=gen))
        p, q = dist(gen, k + 1), dist(gen, k)
        draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        u_accept = torch.rand(k, generator=gen, dtype=torch.float64)
        u_target = torch.rand(k + 1, generator=gen, dtype=torch.float64)
        ids = torch.arange(V).expand(k, V)
        accepted, nxt = speculative_verify(p[None], ids[None], q[None].float(), torch.tensor([draft]),
                                           torch.tensor([k]), torch.tensor([False]), u_accept[None], u_target[None])
        path, token = tree_verify(p[0], p[1:], q, draft, list(range(-1, k - 1)), False, u_accept, u_target)
        assert (len(path), token) == (int(accepted[0]), int(nxt[0]))


def sample_tree(gen: torch.Generator, p1: torch.Tensor, p2: torch.Tensor, p3: torch.Tensor, q1: torch.Tensor,
                q2: torch.Tensor, widths: tuple[int, int]) -> tuple[list[int], int]:
    """One draft tree (widths[0] children of the root, widths[1] under each) drawn i.i.d. from the
    draft (q1 first, q2[x] after x), verified against the target (p1, then p2[x], then p3[x, y])."""
    tokens, parents = [], []
    for x in torch.multinomial(q1, widths[0], replacement=True, generator=gen).tolist():
        tokens.append(x)
        parents.append(-1)
        at = len(tokens) - 1
        for y in torch.multinomial(q2[x], widths[1], replacement=True, generator=gen).tolist():
            tokens.append(y)
            parents.append(at)
    n = len(tokens)
    p = torch.stack([p2[tokens[i]] if parents[i] < 0 else p3[tokens[parents[i]], tokens[i]] for i in range(n)])
    q = torch.stack([q1 if parents[i] < 0 else q2[tokens[parents[i]]] for i in range(n)])  # what each was drawn from
    path, nxt = tree_verify(p1, p, q, tokens, parents, False, torch.rand(n, generator=gen, dtype=torch.float64),
                            torch.rand(3, generator=gen, dtype=torch.float64))
    return [tokens[i] for i in path] + [nxt], len(path)


def run_trees(widths: tuple[int, int], trials: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    p1, p2, p3 = dist(gen), dist(gen, V), dist(gen, V, V)
    q1, q2 = dist(gen), dist(gen, V)  # a draft unlike the target: many rejections
    first, second = np.zeros(V), np.zeros((V, V))
    for _ in range(trials):
        committed, _ = sample_tree(gen, p1, p2, p3, q1, q2, widths)
        first[committed[0]] += 1
        if len(committed) > 1:
            second[committed[0], committed[1]] += 1
    return first, second, p1.numpy(), p2.numpy()


def consistent(observed: np.ndarray, probs: np.ndarray) -> bool:
    return chisquare(observed, probs * observed.sum()).pvalue > P_MIN


@pytest.mark.parametrize("widths", [(1, 1), (3, 2), (4, 1)], ids=["chain", "3x2", "4x1"])
def test_committed_tokens_follow_the_target(widths):
    # (seed 3: at 6000 trials seed 1's 3x2 tree reads p = 3e-4, and 0.11 at 30000: chance, not bias)
    first, second, p1, p2 = run_trees(widths, trials=6000, seed=3)
    assert consistent(first, p1)
    # After an accepted first token x, the next is distributed as the target's p2[x], however x
    # was chosen among its siblings.
    for x in range(V):
        if second[x].sum() > 300:
            assert consistent(second[x], p2[x]), x


def test_a_wrong_residual_update_fails_the_same_test(monkeypatch):
    """The negative control: keeping r after a rejection (no residual) over-commits the tokens a
    draft likes; the chi-square test must see it."""
    monkeypatch.setattr(tree_module, "residual_after_rejection", lambda r, q: r)
    first, _, p1, _ = run_trees((4, 1), trials=6000)
    assert not consistent(first, p1)


def test_greedy_walks_the_targets_argmax_path():
    gen = torch.Generator().manual_seed(3)
    p = dist(gen, 4)
    p_root = dist(gen)
    best = int(p_root.argmax())
    # Root children: a wrong token, then the argmax; under the argmax: its argmax and another.
    tokens = [(best + 1) % V, best, int(p[1].argmax()), (int(p[1].argmax()) + 1) % V]
    parents = [-1, -1, 1, 1]
    path, nxt = tree_verify(p_root, p, None, tokens, parents, True, torch.zeros(4, dtype=torch.float64),
                            torch.zeros(3, dtype=torch.float64))
    assert path == [1, 2] and nxt == int(p[2].argmax())


def test_depths_and_ranks_pick_each_nodes_uniform_stream():
    # a(0) -> c(1), d(2); b(3) -> e(4): depth-first order
    assert depths_and_ranks([-1, 0, 0, -1, 3]) == ([1, 2, 2, 1, 2], [0, 0, 1, 1, 2])
    assert depths_and_ranks([-1, 0, 1]) == ([1, 2, 3], [0, 0, 0])  # a chain: the plain streams


def test_tree_size_counts_every_branchs_nodes():
    assert [tree_size(4, 1, 0), tree_size(4, 3, 0), tree_size(4, 3, 1), tree_size(1, 3, 2), tree_size(0, 3, 1)] == \
        [4, 12, 6, 3, 0]


def test_malformed_trees_are_named():
    assert tree_problem([-1, 0], 2) is None
    assert "parent must come before it" in tree_problem([1, -1], 2)
    assert "needs 3 parents" in tree_problem([-1, 0], 3)
    assert "at most" in tree_problem([-1] * (MAX_TREE_NODES + 1), MAX_TREE_NODES + 1)
