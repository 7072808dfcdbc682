"""Sampled speculative output has exactly the target's distribution.

A tiny-vocabulary target lets us enumerate every 3-token continuation and compute its exact
probability with Hugging Face's own logits processors; thousands of seeded speculative runs are
then compared with a chi-square test, for each drafter.
"""
import functools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaForCausalLM
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec import LocalEngine, SamplingParams

from checkpoints import build_checkpoint, perturbed_copy, predraft_always, self_draft_weights, use_policy

VOCAB = 6
PROMPT = [1, 4, 2]
NEW = 3
SAMPLES = 3000
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
PARAMS = {
    "temperature": dict(temperature=1.0),
    "filters": dict(temperature=0.8, top_k=4, top_p=0.9, repetition_penalty=1.3),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    # A gentler init than the greedy tests: the distribution should have many likely sequences.
    target = build_checkpoint(tmp_path_factory.mktemp("dist-target"), seed=3, initializer_range=0.08, **SHAPE)
    return {
        "target": target,
        "perturbed": perturbed_copy(target, tmp_path_factory.mktemp("dist-draft"), noise=0.8),
        "random": build_checkpoint(tmp_path_factory.mktemp("dist-random"), seed=11, initializer_range=0.08,
                                   **SHAPE),
    }


def exact_distribution(model_dir, params: dict, new: int = NEW, prompt: list[int] = PROMPT,
                       ) -> dict[tuple[int, ...], float]:
    """P(seq) for every continuation of `new` tokens, by Hugging Face's model and processors."""
    return dict(_exact_distribution(str(model_dir), tuple(sorted(params.items())), new, tuple(prompt)))


@functools.cache
def _exact_distribution(model_dir: str, params: tuple, new: int, prompt: tuple[int, ...],
                        ) -> tuple[tuple[tuple[int, ...], float], ...]:
    model, processors = LlamaForCausalLM.from_pretrained(model_dir).eval(), hf_processors(dict(params))

    def next_probs(ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([ids])
        with torch.no_grad():
            return torch.softmax(processors(ids, model(ids).logits[:, -1, :]), dim=-1)[0]

    return tuple(sorted(continuation_probs(next_probs, new, prompt).items()))


def hf_processors(params: dict) -> LogitsProcessorList:
    """Hugging Face's own logits processors for the sampling `params` (the reference's rules)."""
    processors = LogitsProcessorList()
    if params.get("repetition_penalty", 1.0) != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params["repetition_penalty"]))
    processors.append(TemperatureLogitsWarper(params.get("temperature", 1.0)))
    if params.get("top_k", 0):
        processors.append(TopKLogitsWarper(params["top_k"]))
    if params.get("top_p", 1.0) < 1.0:
        processors.append(TopPLogitsWarper(params["top_p"]))
    return processors


def continuation_probs(next_probs, new: int, prompt) -> dict[tuple[int, ...], float]:
    """P(seq) for every continuation of `new` tokens after `prompt`, where `next_probs(ids)` is the
    distribution (VOCAB,) after ids: one call per prefix of nonzero probability, not one per
    (sequence, position), and each P the same product in the same order either way."""
    prefixes = {(): 1.0}
    for _ in range(new):
        longer = {}
        for prefix, prob in prefixes.items():
            probs = next_probs(list(prompt) + list(prefix)) if prob != 0.0 else torch.zeros(VOCAB)
            longer.update({prefix + (t,): prob * probs[t].item() for t in range(VOCAB)})
        prefixes = longer
    return prefixes


def chi_square_pvalue(samples: list[tuple[int, ...]], dist: dict) -> float:
    counts = {s: 0 for s in dist}
    for s in samples:
        assert dist[s] > 0, f"sampled impossible sequence {s}"
        counts[s] += 1
    # Pool rare outcomes so every expected count is large enough for the chi-square test.
    observed, expected, rare_obs, rare_exp = [], [], 0, 0.0
    for s, p in dist.items():
        if p * len(samples) >= 5:
            observed.append(counts[s])
            expected.append(p * len(samples))
        else:
            rare_obs += counts[s]
            rare_exp += p * len(samples)
    if rare_exp > 0:
        observed.append(rare_obs)
        expected.append(rare_exp)
    expected = np.array(expected) * (len(samples) / sum(expected))
    return chisquare(observed, expected).pvalue


# K fixed for every drafter; K chosen per round (jumping between 0 and the cap, or by the adaptive
# policy from each request's acceptance) for the drafters where it changes what is decided.
CASES = [(d, "fixed") for d in ("none", "perturbed", "random", "ngram", "self")] + [
    ("perturbed", "jumping"), ("ngram", "jumping"), ("self", "jumping"), ("perturbed", "adaptive"),
    ("ngram", "adaptive")]


@pytest.mark.parametrize("params_name", sorted(PARAMS))
@pytest.mark.parametrize("drafter,policy", CASES)
def test_sampled_sequences_follow_target_distribution(models, drafter, policy, params_name):
    params = PARAMS[params_name]
    dist = exact_distribution(models["target"], params)
    draft = {"none": None, "ngram": "ngram", "self": str(models["target"])}.get(drafter, str(models.get(drafter)))
    engine = LocalEngine(str(models["target"]), draft=draft, num_speculative_tokens=3, max_batch_size=1000,
                         adaptive=False, **self_draft_weights(drafter))
    if draft is not None:
        use_policy(engine, policy)
    sp = [SamplingParams(max_new_tokens=NEW, ignore_eos=True, seed=1000 + i, **params) for i in range(SAMPLES)]
    outputs = engine.generate([PROMPT] * SAMPLES, sp)
    samples = [tuple(o.token_ids) for o in outputs]
    assert chi_square_pvalue(samples, dist) > 1e-3
    rates = [o.stats.acceptance_rate for o in outputs if o.stats.acceptance_rate is not None]
    if drafter != "none":
        assert len(rates) > SAMPLES // 10  # speculation really happened (n-gram: when a match exists)
    if drafter == "self":
        assert all(r == 1.0 for r in rates)
    if drafter in ("perturbed", "random"):
        assert 0.0 < float(np.mean(rates)) < 1.0  # both paths (accept and resample) were exercised
    engine.target_worker.cache.check_accounting()
    assert engine.target_worker.cache.allocator.num_used == 0


@pytest.mark.parametrize("params_name", sorted(PARAMS))
@pytest.mark.parametrize("drafter", ["perturbed", "self"])
def test_overlapped_rounds_follow_target_distribution(models, drafter, params_name):
    """Overlapped drafting (the default) with K=1 over 4 tokens: round 2's proposal is the
    pre-draft made while round 1 was verified whenever round 1 committed what it assumed, so both
    kept and dropped pre-drafts shape the samples; the joint distribution is still the target's."""
    params = PARAMS[params_name]
    new = NEW + 1
    dist = exact_distribution(models["target"], params, new=new)
    draft = str(models["target"]) if drafter == "self" else str(models[drafter])
    kept = []
    engine = LocalEngine(str(models["target"]), draft=draft, num_speculative_tokens=1, max_batch_size=1000,
                         adaptive=False, overlap=True, **self_draft_weights(drafter),
                         on_round=lambda report: kept.append(report.predraft_kept))
    predraft_always(engine.scheduler)
    sp = [SamplingParams(max_new_tokens=new, ignore_eos=True, seed=5000 + i, **params) for i in range(SAMPLES)]
    samples = [tuple(o.token_ids) for o in engine.generate([PROMPT] * SAMPLES, sp)]
    assert chi_square_pvalue(samples, dist) > 1e-3
    assert sum(kept) > SAMPLES // 10  # pre-drafts were really kept
    engine.target_worker.cache.check_accounting()
    assert engine.target_worker.cache.allocator.num_used == 0


# Trees: the root's children drawn without replacement, each continued as a chain.
TREE_PARAMS = {"temperature": dict(temperature=1.0), "hot": dict(temperature=1.5),
               "filters": dict(temperature=0.7, top_k=4, top_p=0.9)}


def tree_samples(models, drafter: str, params: dict, seed: int, prompt: list[int] = PROMPT, side_depth: int = 0,
                 policy: str = "fixed") -> tuple[list[tuple[int, ...]], list[float]]:
    draft = {"self": str(models["target"]), "ngram": "ngram"}.get(drafter) or str(models[drafter])
    trees = []
    engine = LocalEngine(str(models["target"]), draft=draft, num_speculative_tokens=2, max_batch_size=1000,
                         adaptive=False, tree_branches=3, tree_side_depth=side_depth, **self_draft_weights(drafter),
                         on_round=lambda report: trees.extend(u.tree_nodes for u in report.updates if u.tree_nodes))
    use_policy(engine, policy)
    sp = [SamplingParams(max_new_tokens=NEW, ignore_eos=True, seed=seed + i, **params) for i in range(SAMPLES)]
    outputs = engine.generate([prompt] * SAMPLES, sp)
    # Trees of up to 3 branches were verified (fewer where q has fewer tokens), 2 deep, or 1 where
    # max_new_tokens leaves room for one (a jumping policy: a chain or K = 0 in half the rounds).
    assert len(trees) > SAMPLES // (2 if policy == "fixed" else 4) and max(trees) == (6 if side_depth == 0 else 4)
    engine.target_worker.cache.check_accounting()
    assert engine.target_worker.cache.allocator.num_used == 0
    rates = [o.stats.acceptance_rate for o in outputs if o.stats.acceptance_rate is not None]
    return [tuple(o.token_ids) for o in outputs], rates


@pytest.mark.parametrize("params_name", sorted(TREE_PARAMS))
@pytest.mark.parametrize("drafter", ["perturbed", "random", "self"])
def test_token_trees_follow_target_distribution(models, drafter, params_name):
    samples, rates = tree_samples(models, drafter, TREE_PARAMS[params_name], seed=7000)
    assert chi_square_pvalue(samples, exact_distribution(models["target"], TREE_PARAMS[params_name])) > 1e-3
    if drafter == "self":
        assert all(r == 1.0 for r in rates)
    else:
        assert 0.0 < float(np.mean(rates)) < 1.0  # both paths (accept and resample) were exercised


@pytest.mark.parametrize("params_name", ["temperature", "filters"])
def test_trees_with_leaf_side_branches_follow_target_distribution(models, params_name):
    """tree_side_depth 1: the root's other children are leaves beside a 2-deep first branch."""
    samples, rates = tree_samples(models, "perturbed", TREE_PARAMS[params_name], seed=8000, side_depth=1)
    assert chi_square_pvalue(samples, exact_distribution(models["target"], TREE_PARAMS[params_name])) > 1e-3
    assert 0.0 < float(np.mean(rates)) < 1.0


# A strong penalty after a one-token prompt: most tokens are not yet present, so what a node's path
# adds to its presence set moves its distribution (and top-k/top-p make some sequences impossible).
PENALTY_PARAMS, PENALTY_PROMPT = dict(temperature=0.9, top_k=5, top_p=0.95, repetition_penalty=2.0), [5]


def test_trees_with_a_repetition_penalty_follow_target_distribution(models):
    """Each node's q and p penalise the committed tokens and the tokens on its own path, so the
    branches' distributions differ."""
    samples, rates = tree_samples(models, "perturbed", PENALTY_PARAMS, seed=9700, prompt=PENALTY_PROMPT)
    dist = exact_distribution(models["target"], PENALTY_PARAMS, prompt=PENALTY_PROMPT)
    assert chi_square_pvalue(samples, dist) > 1e-3
    assert 0.0 < float(np.mean(rates)) < 1.0


def test_a_tree_walk_that_penalises_the_committed_tokens_only_fails_the_test(models, monkeypatch):
    """The negative control: the target's walk penalising only the committed tokens (every node's
    path left out of its presence set) commits sequences the target never would."""
    from target_worker import tree_acceptance

    monkeypatch.setattr(tree_acceptance, "node_paths", lambda parents, start: [[] for _ in parents])
    samples, _ = tree_samples(models, "perturbed", PENALTY_PARAMS, seed=9700, prompt=PENALTY_PROMPT)
    with pytest.raises(AssertionError, match="impossible sequence"):
        chi_square_pvalue(samples, exact_distribution(models["target"], PENALTY_PARAMS, prompt=PENALTY_PROMPT))


def test_trees_whose_shape_jumps_round_to_round_follow_target_distribution(models):
    """K and the tree's shape chosen afresh each round (JumpingK: chains, and the other children 1
    or 2 deep), as the policy chooses them: each round's rule is exact whatever its shape."""
    samples, rates = tree_samples(models, "perturbed", TREE_PARAMS["temperature"], seed=9500, policy="jumping")
    assert chi_square_pvalue(samples, exact_distribution(models["target"], TREE_PARAMS["temperature"])) > 1e-3
    assert 0.0 < float(np.mean(rates)) < 1.0


@pytest.mark.parametrize("params_name", ["temperature", "filters"])
def test_ngram_trees_follow_target_distribution(models, params_name):
    """The n-gram drafter's branches: what followed three earlier matches of the last token, each
    node a point mass (q one-hot), verified as one tree."""
    prompt = [1, 4, 2, 1, 3, 5, 1, 5, 2, 1]  # 1 was followed by 4, 3 and 5: three branches 2 deep
    samples, rates = tree_samples(models, "ngram", TREE_PARAMS[params_name], seed=9000, prompt=prompt)
    assert chi_square_pvalue(samples, exact_distribution(models["target"], TREE_PARAMS[params_name],
                                                         prompt=prompt)) > 1e-3
    assert 0.0 < float(np.mean(rates)) < 1.0


def test_a_wrong_residual_update_in_trees_fails_the_test(models, monkeypatch):
    """The negative control: a tree walk that keeps the target's p after a rejected child (no
    residual) commits the tokens the draft likes too often; the same test must see it."""
    from specdec.sampling import tree

    monkeypatch.setattr(tree, "residual_after_rejection", lambda r, q: r)
    samples, _ = tree_samples(models, "perturbed", TREE_PARAMS["filters"], seed=7000)
    assert chi_square_pvalue(samples, exact_distribution(models["target"], TREE_PARAMS["filters"])) < 1e-3


def test_distinct_children_sent_with_the_unrestricted_q_fail_the_test(models, monkeypatch):
    """The other negative control: children drawn without replacement but each sent with the q
    before any was removed (the i.i.d. rule applied to dependent draws) mis-weights the later
    children; the same test must see it. With top-k/top-p q is peaked and the error large (p ~
    1e-24 here); at T=1 over 6 tokens it is below what 3000 samples resolve (p 0.08-0.99)."""
    from draft_worker import draft_tree, model_drafter

    def unrestricted(*args):
        tokens, rows = draft_tree.distinct_children(*args)
        return tokens, [rows[0]] * len(rows)

    monkeypatch.setattr(model_drafter, "distinct_children", unrestricted)
    samples, _ = tree_samples(models, "perturbed", TREE_PARAMS["filters"], seed=7000)
    assert chi_square_pvalue(samples, exact_distribution(models["target"], TREE_PARAMS["filters"])) < 1e-3
