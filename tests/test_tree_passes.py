"""Token trees in one forward pass: every node's logits are those of its root-to-node path run as
a chain (siblings never see each other), in the C kernels and in torch's attention, in one pass,
across passes (how the draft grows a tree a depth at a time) and after a long prompt fed in
chunks; keeping the accepted path leaves the cache as if only that path had been fed."""
from __future__ import annotations

import pytest
import torch

from specdec.config import WorkerConfig
from specdec.model.batch import TreeNodes
from specdec.model.decoder import load_model
from specdec.model.runner import ModelRunner
from specdec.sampling.tree import leading_chain, node_paths
from tests.checkpoints import CONFIGS, build_checkpoint

PROMPT = [5, 17, 42, 8, 3, 77, 21]
# a(0) -> c(1), d(2); b(3) -> e(4): depth-first order, parent node of each.
TOKENS, PARENTS = [11, 12, 13, 14, 15], [-1, 0, 0, -1, 3]


def chain_of(node: int) -> list[int]:
    path = []
    while node >= 0:
        path.insert(0, TOKENS[node])
        node = PARENTS[node]
    return path


@pytest.fixture(scope="module", params=["kernels", "torch"])
def runner_factory(request, tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("tree-pass"), seed=3, **CONFIGS["gqa_untied"])
    model = load_model(path, cpu_kernels=request.param == "kernels")
    assert (model.kernels is not None) == (request.param == "kernels")
    return lambda **settings: ModelRunner(model, WorkerConfig(kv_cache_blocks=64, kv_block_size=4, **settings))


def chain_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    runner.cache.add_sequence("chain")
    try:
        return runner.run(["chain"], [tokens], [1])[0][0]
    finally:
        runner.cache.free_sequence("chain")


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_each_node_sees_its_path_only_in_one_pass(runner_factory):
    runner = runner_factory()
    runner.cache.add_sequence("s")
    start = len(PROMPT)
    logits = runner.run(["s"], [PROMPT + TOKENS], [1 + len(TOKENS)], [TreeNodes(start, node_paths(PARENTS, start))])[0]
    assert_same(logits[0], chain_logits(runner, PROMPT))
    for node in range(len(TOKENS)):
        assert_same(logits[1 + node], chain_logits(runner, PROMPT + chain_of(node)))


def test_a_trees_leading_chain_fed_as_causal_tokens_gives_the_same_logits(runner_factory):
    """The target worker's pass: a(0) -> c(1) lead the tree as a chain, fed as the sequence's own
    tokens; d(2), b(3) and e(4) take rows of their own (their paths may pass through a or c)."""
    runner = runner_factory()
    runner.cache.add_sequence("s")
    start, lead = len(PROMPT), leading_chain(PARENTS)
    assert lead == 2
    logits = runner.run(["s"], [PROMPT + TOKENS], [1 + len(TOKENS)],
                        [TreeNodes(start, node_paths(PARENTS, start)[lead:])])[0]
    assert_same(logits[0], chain_logits(runner, PROMPT))
    for node in range(len(TOKENS)):
        assert_same(logits[1 + node], chain_logits(runner, PROMPT + chain_of(node)))


def test_a_tree_grown_a_depth_per_pass_beside_a_chain(runner_factory):
    runner = runner_factory()
    for seq in ("s", "other"):
        runner.cache.add_sequence(seq)
    start = len(PROMPT)
    runner.run(["s", "other"], [PROMPT, [9, 8, 7]], [1, 1])
    first = runner.run(["s", "other"], [[11, 14], [6]], [2, 1], [TreeNodes(start, [[start], [start + 1]]), None])
    second = runner.run(["s"], [[12, 15]], [2], [TreeNodes(start, [[start, start + 2], [start + 1, start + 3]])])[0]
    for row, path in ((first[0][0], [11]), (first[0][1], [14]), (second[0], [11, 12]), (second[1], [14, 15])):
        assert_same(row, chain_logits(runner, PROMPT + path))
    assert_same(first[1][0], chain_logits(runner, [9, 8, 7, 6]))


def test_keeping_the_accepted_path_leaves_the_cache_of_that_chain(runner_factory):
    runner = runner_factory()
    runner.cache.add_sequence("s")
    start = len(PROMPT)
    runner.run(["s"], [PROMPT + TOKENS], [1], [TreeNodes(start, node_paths(PARENTS, start))])
    runner.cache.keep_path("s", start, [start + 3, start + 4])  # b, e
    assert runner.cache.length("s") == start + 2
    runner.cache.check_accounting()
    after = runner.run(["s"], [[99]], [1])[0][0]
    assert_same(after, chain_logits(runner, PROMPT + [14, 15, 99]))


def test_a_tree_after_a_prompt_longer_than_a_chunk(runner_factory):
    runner = runner_factory(prefill_chunk_tokens=4)
    runner.cache.add_sequence("s")
    prompt = PROMPT * 2
    start = len(prompt)
    logits = runner.run(["s"], [prompt + TOKENS], [3], [TreeNodes(start, node_paths(PARENTS, start))])[0]
    for row, node in zip(logits, (2, 3, 4)):
        assert_same(row, chain_logits(runner, prompt + chain_of(node)))


def test_a_path_that_does_not_end_at_its_node_is_refused(runner_factory):
    runner = runner_factory()
    runner.cache.add_sequence("s")
    with pytest.raises(ValueError, match="must ascend"):
        runner.run(["s"], [PROMPT + [11, 12]], [1], [TreeNodes(len(PROMPT), [[7], [7]])])
    assert runner.cache.length("s") == 0
