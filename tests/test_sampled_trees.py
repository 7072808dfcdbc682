"""Temperature-only requests' token trees walked in C (CpuKernels.verify_sampled_tree): the same
accepted path and next token as specdec.sampling.tree.tree_verify, whose chi-square suites and
negative controls pin the rule down, on walks that accept a first child, accept a later one after
rejections, reject every child and reach a leaf; accept_tree takes that path for temperature-only
requests alone; a NaN and malformed trees are refused. The draft's other children of a node are
drawn in C as in numpy, bit for bit."""
from __future__ import annotations

import pytest
import torch

from draft_worker.draft_tree import distinct_children
from specdec.model.cpu_kernels import KernelArgumentError, load_cpu_kernels
from specdec.params import SamplingParams
from specdec.round_types import SparseDist, VerifyTask
from specdec.sampling import BatchSamplingParams, probs_from_logits
from specdec.sampling.tree import chains_parents, tree_verify
from target_worker.tree_acceptance import accept_tree

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler on this machine")
COMMITTED = 9  # the requests' committed tokens: their first node's position
SHAPES = [chains_parents([3, 1, 1]), chains_parents([2, 2, 2]), chains_parents([1, 1, 1, 1]),
          [-1, 0, 0, 1, -1, 4]]  # (the last: a node with two children below the root's first)


def drafted_tree(target: torch.Tensor, parents: list[int], noise: float, params: SamplingParams, gen) -> VerifyTask:
    """Each node drawn from q, the softmax of its parent's target row plus noise, top 64 kept."""
    rows = target[[parent + 1 for parent in parents]] + noise * torch.randn(len(parents), target.shape[-1],
                                                                          generator=gen)
    q = probs_from_logits(rows, BatchSamplingParams.from_params([params] * len(parents), "cpu"))
    top, ids = torch.topk(q, min(64, q.shape[-1]), dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    tokens = ids.gather(1, torch.multinomial(top, 1, generator=gen)).squeeze(1).tolist()
    return VerifyTask("r", [], tokens, SparseDist(token_ids=ids, probs=top), params, parents=parents)


def torch_walk(task: VerifyTask, target: torch.Tensor, seed: int) -> tuple[list[int], int]:
    return accept_tree(task, [0] * COMMITTED, seed, target, target.shape[-1], kernels=None)


def test_a_tree_walked_in_c_is_tree_verifys_walk():
    gen = torch.Generator().manual_seed(0)
    seen = {"first child": 0, "later child": 0, "all rejected": 0, "to a leaf": 0}
    for trial in range(300):
        vocab, parents = [4096, 50, 1000][trial % 3], SHAPES[trial % len(SHAPES)]
        params = SamplingParams(temperature=[0.8, 1.0, 0.3][trial % 3], seed=trial)
        target = torch.randn(len(parents) + 1, vocab, generator=gen) * 2
        task = drafted_tree(target, parents, [0.3, 1.5][trial % 2], params, gen)
        path, nxt = accept_tree(task, [0] * COMMITTED, trial, target, vocab, kernels)
        assert (path, nxt) == torch_walk(task, target, trial)
        firsts = {min(c for c, p in enumerate(parents) if p == parent) for parent in [-1, *range(len(parents))]
                  if parent in parents}
        seen["later child"] += any(node not in firsts for node in path)
        seen["first child"] += any(node in firsts for node in path)
        seen["to a leaf"] += bool(path) and path[-1] not in parents
        seen["all rejected"] += not path or path[-1] in parents
    assert min(seen.values()) >= 20, seen  # every branch of the walk, many times


def test_only_temperature_only_requests_take_the_c_walk(monkeypatch):
    """Top-k (and greedy) requests keep torch's walk, a NaN in a row the walk reads too."""
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(6, 300, generator=gen) * 2
    walked = []
    monkeypatch.setattr(type(kernels), "verify_sampled_tree",
                        lambda self, *args: walked.append(args) or None)  # (None: as if a NaN)
    for params in (SamplingParams(temperature=0.9, seed=3), SamplingParams(temperature=0.9, top_k=5, seed=3)):
        task = drafted_tree(target, SHAPES[0], 0.5, params, gen)
        assert accept_tree(task, [0] * COMMITTED, 3, target, 300, kernels) == torch_walk(task, target, 3)
    assert len(walked) == 1  # the temperature-only request's, whose None fell back to torch
    monkeypatch.undo()
    target[0, 17] = float("nan")  # (the root's row: every walk reads it)
    task = drafted_tree(target.nan_to_num(), SHAPES[0], 0.5, SamplingParams(temperature=1.0, seed=4), gen)
    u = torch.full((len(task.draft_tokens),), 0.5, dtype=torch.float64)
    assert kernels.verify_sampled_tree(target, 1.0, task.draft_tokens, task.parents, task.q.token_ids,
                                       task.q.probs, u, torch.full((5,), 0.5, dtype=torch.float64)) is None


def test_a_malformed_tree_is_refused():
    target = torch.randn(4, 20, generator=torch.Generator().manual_seed(2))
    ids, probs = torch.tensor([[4, 5]] * 3), torch.tensor([[0.5, 0.5]] * 3)
    u = torch.full((3,), 0.5, dtype=torch.float64)
    walk = kernels.verify_sampled_tree(target, 1.0, [4, 5, 4], [-1, 0, -1], ids, probs, u, u)
    assert walk is not None and walk[0] in ([], [0], [0, 1], [2]) and 0 <= walk[1] < 20
    for tokens, parents, u_next in (([4, 20, 4], [-1, 0, -1], u), ([4, 5, 4], [-1, 2, -1], u),
                                    ([4, 5, 4], [-1, 0, 1], u), ([4, 5, 4], [-1, 0, -1], u[:2])):
        with pytest.raises(KernelArgumentError, match="verify_sampled_tree"):
            kernels.verify_sampled_tree(target, 1.0, tokens, parents, ids, probs, u, u_next)


def test_tree_verify_and_the_c_walk_agree_on_a_chain():
    """A tree of one branch (never sent as a tree, but a tree all the same): the chain's walk."""
    gen = torch.Generator().manual_seed(3)
    target = torch.randn(4, 100, generator=gen) * 2
    task = drafted_tree(target, [-1, 0, 1], 1.0, SamplingParams(temperature=1.0, seed=5), gen)
    p = probs_from_logits(target, BatchSamplingParams.from_params([task.params] * 4, "cpu"))
    u_accept = torch.tensor([0.3, 0.6, 0.9], dtype=torch.float64)
    u_next = torch.tensor([0.1, 0.5, 0.7, 0.2], dtype=torch.float64)
    expected = tree_verify(p[0], p[1:], task.q.to_dense(100), task.draft_tokens, task.parents, False, u_accept, u_next)
    assert kernels.verify_sampled_tree(target, 1.0, task.draft_tokens, task.parents, task.q.token_ids,
                                       task.q.probs, u_accept, u_next) == expected


@pytest.mark.parametrize("count", [2, 3, 6])
def test_distinct_children_drawn_in_c_are_numpys_bit_for_bit(count):
    """The draft's other children of a node (draft_tree.distinct_children): in C and in numpy the
    same tokens and the same distributions, bit for bit, on peaked and flat q rows of 1-256 tokens
    (a row with fewer tokens than children gives fewer); each child distinct, drawn from its row."""
    gen = torch.Generator().manual_seed(count)
    for trial in range(200):
        width = [256, 64, 3, 1][trial % 4]
        ids = torch.randperm(4096, generator=gen)[:width]
        q = torch.softmax(torch.randn(width, generator=gen) * [0.5, 4.0][trial % 2], dim=0)
        first = int(ids[torch.multinomial(q, 1, generator=gen)])
        in_c = distinct_children(first, (ids, q), count, trial, 50 + trial, kernels)
        in_numpy = distinct_children(first, (ids, q), count, trial, 50 + trial, None)
        assert in_c[0] == in_numpy[0] and len(in_c[0]) == min(count, width) == len(set(in_c[0]))
        for (c_ids, c_q), (n_ids, n_q) in zip(in_c[1], in_numpy[1]):
            assert torch.equal(c_ids, n_ids) and torch.equal(c_q, n_q)
        for token, (_, row) in zip(in_c[0][1:], in_c[1][1:]):
            assert float(row[ids == token]) > 0.0 and torch.all(row[torch.isin(ids, torch.tensor(in_c[0][:1]))] == 0)
