"""Token trees end to end (scheduler.tree_branches): greedy output is the target's own, token for
token, for every drafter and with K fixed or chosen per round; a seeded sampled request gives the
same tokens with trees as alone or in a batch; the target and the draft keep only the accepted
path in their caches; a malformed tree is refused without touching the round's other requests."""
from __future__ import annotations

import collections

import pytest
import torch

from specdec import LocalEngine, SamplingParams
from specdec.round_types import DraftTask, VerifyTask
from target_worker.worker import TargetWorker

from checkpoints import CONFIGS, build_checkpoint, hf_greedy, perturbed_copy, self_draft_weights, use_policy

PROMPTS = [[3, 17, 42, 7, 99, 12, 5], [8, 8, 8, 21, 30, 8, 8, 8, 21], [150], list(range(40, 72))]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = build_checkpoint(tmp_path_factory.mktemp("tree-target"), seed=0, **CONFIGS["gqa_untied"])
    return {"target": str(target), "self": str(target),
            "perturbed": str(perturbed_copy(target, tmp_path_factory.mktemp("tree-perturbed"), noise=0.3)),
            "random": str(build_checkpoint(tmp_path_factory.mktemp("tree-random"), seed=7,
                                           **{**CONFIGS["gqa_untied"], "num_hidden_layers": 1})),
            "ngram": "ngram"}


@pytest.fixture(scope="module")
def references(models):
    return [hf_greedy(models["target"], p, NEW_TOKENS) for p in PROMPTS]


def tree_rounds(engine: LocalEngine) -> list[int]:
    """Counts, round by round, the verify tasks that carried a tree (wraps the target's verify)."""
    counts, verify = [], engine.scheduler.target.verify

    def counted(tasks, finished):
        counts.append(sum(bool(t.parents) for t in tasks))
        return verify(tasks, finished)

    engine.scheduler.target.verify = counted
    return counts


def assert_caches_empty(engine: LocalEngine) -> None:
    for cache in (engine.target_worker.cache, engine.draft_worker.drafter.kv_cache):
        if cache is not None:
            cache.check_accounting()
            assert cache.allocator.num_used == 0


@pytest.mark.parametrize("drafter", ["perturbed", "self", "random", "ngram"])
@pytest.mark.parametrize("policy,side_depth", [("fixed", 0), ("jumping", 0), ("fixed", 1), ("adaptive", 1)])
def test_greedy_trees_give_the_targets_tokens(models, references, drafter, policy, side_depth):
    engine = use_policy(LocalEngine(models["target"], draft=models[drafter], num_speculative_tokens=3,
                                    kv_block_size=8, adaptive=False, tree_branches=3, tree_side_depth=side_depth,
                                    **self_draft_weights(drafter)),
                        policy)
    trees = tree_rounds(engine)
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outputs] == references
    # (The n-gram drafter's trees need earlier matches followed by different tokens; where the first
    # child is always kept, drafting itself, the policy's trees soon give way to chains.)
    if drafter != "ngram" and (drafter, policy) != ("self", "adaptive"):
        assert sum(trees) > 0
    if drafter == "self":  # the target drafting for itself: its first branch is always kept
        assert all(o.stats.acceptance_rate == 1.0 for o in outputs)
    assert_caches_empty(engine)


def test_greedy_trees_with_a_repetition_penalty_give_plain_decodings_tokens(models):
    """With a repetition penalty the root's children are the top tokens after the penalty and each
    branch is penalised by its own path: trees are drafted, and the output is plain decoding's."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=1.5)
    plain = LocalEngine(models["target"]).generate(PROMPTS, params)
    engine = LocalEngine(models["target"], draft=models["perturbed"], num_speculative_tokens=3, kv_block_size=8,
                         adaptive=False, tree_branches=3)
    trees = tree_rounds(engine)
    outputs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert sum(trees) > 0
    assert_caches_empty(engine)


def test_each_draft_has_its_policys_shape_and_a_tree_round_says_which_root_child_was_kept(models):
    """Each draft task has the shape the policy chose for its request that round (here shapes that
    jump: chains, and trees whose other children are 1 to 3 deep); a tree round reports the root's
    other children tried where the first child is not the target's token, and kept where one of
    them is (greedy: the target's token is the one committed first)."""
    engine = use_policy(LocalEngine(models["target"], draft=models["perturbed"], num_speculative_tokens=3,
                                    kv_block_size=8, adaptive=False, tree_branches=3, tree_side_depth=0), "jumping")
    policy, propose, proposals, shapes = engine.scheduler.policy, engine.scheduler.draft.propose, {}, []

    def recorded(tasks, finished):
        shapes.extend(((t.branches, t.side_depth), policy.tree_shape(t.req_id)) for t in tasks)
        replies = propose(tasks, finished)
        proposals.update((reply.req_id, reply) for reply in replies)
        return replies

    engine.scheduler.draft.propose = recorded
    walks = collections.Counter()

    def check(report):
        for u in (u for u in report.updates if u.tree_nodes):
            tokens, parents = proposals[u.req_id].tokens, proposals[u.req_id].parents
            others = [t for t, parent in zip(tokens[1:], parents[1:]) if parent == -1]
            assert u.side_tried == (u.token_ids[0] != tokens[0])
            assert u.side_kept == (u.side_tried and u.token_ids[0] in others)
            walks[u.side_tried, u.side_kept] += 1

    engine.on_round = check
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert shapes and all(sent == chosen for sent, chosen in shapes)
    assert {shape for shape, _ in shapes} >= {(1, 0), (3, 1), (3, 2), (3, 3)}
    assert walks[True, True] and walks[True, False]  # (measured: 2 kept, 21 not)
    assert_caches_empty(engine)


def test_seeded_trees_are_reproducible_alone_and_in_a_batch(models):
    engine = LocalEngine(models["target"], draft=models["perturbed"], num_speculative_tokens=3, adaptive=False,
                         tree_branches=2)
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, seed=11 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    params[3] = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.7, top_k=20, top_p=0.9, seed=2**64 - 1,
                               ignore_eos=True)
    batched = [o.token_ids for o in engine.generate(PROMPTS, params)]
    alone = [engine.generate([p], [sp])[0].token_ids for p, sp in zip(PROMPTS, params)]
    assert batched == alone
    assert_caches_empty(engine)


def test_a_trees_first_branch_is_the_chain(models):
    """Rank 0 keeps the plain uniform streams: a tree's first branch is the chain the same request
    drafts without a tree (tokens and q); the root's other children are drawn without replacement,
    each from q without the children before it (the distribution sent with it)."""
    def propose(branches: int):
        drafter = LocalEngine(models["target"], draft=models["perturbed"]).draft_worker.drafter
        tasks = [DraftTask(f"r{i}", prompt, 4, SamplingParams(temperature=1.0, seed=3 + i), branches=branches)
                 for i, prompt in enumerate(PROMPTS)]
        return drafter.propose(tasks)

    for chain, tree in zip(propose(1), propose(3)):
        assert tree.parents == [-1, 0, 1, 2, -1, 4, 5, 6, -1, 8, 9, 10] and not chain.parents
        assert tree.tokens[:4] == chain.tokens and tree.depth == chain.depth == 4
        assert torch.equal(tree.q.probs[:4], chain.q.probs) and torch.equal(tree.q.token_ids[:4], chain.q.token_ids)
        firsts = [tree.tokens[i] for i in (0, 4, 8)]
        assert len(set(firsts)) == 3
        ids, first_q, second_q = tree.q.token_ids[0], tree.q.probs[0], tree.q.probs[4]
        assert torch.equal(tree.q.token_ids[4], ids) and float(second_q[ids == firsts[0]].sum()) == 0.0
        torch.testing.assert_close(second_q, first_q.masked_fill(ids == firsts[0], 0) / first_q[ids != firsts[0]].sum())


def test_side_branches_as_leaves_leave_the_draft_a_chain(models):
    """tree_side_depth 1: the root's other children are leaves; the first branch is drafted as the
    chain is (fed as a chain: the draft's cache after the round holds the prefix and its nodes)."""
    engine = LocalEngine(models["target"], draft=models["perturbed"])
    drafter = engine.draft_worker.drafter
    task = DraftTask("r", PROMPTS[0], 4, SamplingParams(temperature=1.0, seed=3), branches=3, side_depth=1)
    tree = drafter.propose([task])[0]
    chain = LocalEngine(models["target"], draft=models["perturbed"]).draft_worker.drafter.propose(
        [DraftTask("r", PROMPTS[0], 4, SamplingParams(temperature=1.0, seed=3))])[0]
    assert tree.parents == [-1, 0, 1, 2, -1, -1] and tree.tokens[:4] == chain.tokens
    assert len({tree.tokens[0], tree.tokens[4], tree.tokens[5]}) == 3
    assert drafter.kv_cache.length("r") == len(PROMPTS[0]) + 3  # the prompt, then branch 0's fed nodes


def test_a_malformed_tree_fails_its_own_request_only(models):
    worker = TargetWorker.from_config(LocalEngine(models["target"]).config.target)
    good = VerifyTask("good", [1, 2, 3], [4, 5], None, SamplingParams(), parents=[-1, -1])
    bad = VerifyTask("bad", [1, 2, 3], [4, 5], None, SamplingParams(), parents=[1, -1])
    short = VerifyTask("short", [1, 2, 3], [4, 5], None, SamplingParams(), parents=[-1])
    outcomes = {o.req_id: o for o in worker.verify([good, bad, short], []).outcomes}
    assert "parent must come before it" in outcomes["bad"].error
    assert "needs 2 parents" in outcomes["short"].error
    assert not outcomes["good"].error and len(outcomes["good"].tokens) in (1, 2)
    worker.cache.check_accounting()
    assert worker.cache.length("good") == 3 + outcomes["good"].num_accepted


def test_trees_over_grpc_workers_give_what_they_give_in_process(models, references):
    """The tree fields on the wire (DraftTask.branches, DraftProposal/VerifyTask.parents): greedy
    and seeded sampled requests over gRPC workers get the in-process engine's tokens."""
    from coordinator.rounds.request import Request
    from draft_worker import grpc_server as draft_server
    from draft_worker.worker import DraftWorker
    from specdec_app.embedded import GrpcSchedulerFactory
    from target_worker import grpc_server as target_server

    settings = dict(num_speculative_tokens=3, adaptive=False, tree_branches=2, kv_block_size=8)
    engine = LocalEngine(models["target"], draft=models["perturbed"], **settings)
    trees = tree_rounds(engine)
    seeded = [SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, seed=21 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    want = [o.token_ids for o in engine.generate(PROMPTS, seeded)]
    assert sum(trees) > 0
    config = engine.config
    tserver, tport = target_server.serve(TargetWorker.from_config(config.target))
    dserver, dport = draft_server.serve(DraftWorker.from_config(config.draft))
    try:
        factory = GrpcSchedulerFactory(config, f"127.0.0.1:{tport}", f"127.0.0.1:{dport}")
        scheduler = factory()
        greedy = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            scheduler.add_request(Request(f"g{i}", prompt, greedy))
            scheduler.add_request(Request(f"s{i}", prompt, seeded[i]))
        got = {f"{kind}{i}": [] for kind in "gs" for i in range(len(PROMPTS))}
        while scheduler.has_work() or scheduler.running:
            for update in scheduler.step().updates:
                assert not update.error, update.error
                got[update.req_id] += update.token_ids
        factory.close()
    finally:
        tserver.stop(None)
        dserver.stop(None)
    assert [got[f"g{i}"] for i in range(len(PROMPTS))] == references
    assert [got[f"s{i}"] for i in range(len(PROMPTS))] == want
