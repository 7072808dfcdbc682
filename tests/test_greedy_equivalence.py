"""Greedy speculative output == the target's own greedy output (Hugging Face generate), token for
token, for every drafter, on several model shapes and every model family, with K fixed or chosen
per round (the adaptive policy, or K jumping between 0 and its cap)."""
import pytest

from specdec import LocalEngine, SamplingParams

from checkpoints import (
    CONFIGS,
    FAMILY_CONFIGS,
    build_checkpoint,
    hf_greedy,
    perturbed_copy,
    self_draft_weights,
    use_policy,
)

PROMPTS = [[3, 17, 42, 7, 99, 12, 5], [8, 8, 8, 21, 30, 8, 8, 8, 21], [150], list(range(40, 72))]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def references(target_dir):
    return [hf_greedy(target_dir, p, NEW_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def drafts(target_dir, tmp_path_factory):
    name = target_dir.name.split("-", 1)[1].rstrip("0123456789")
    shape = CONFIGS[name]
    return {
        "none": None,
        "ngram": "ngram",
        "self": str(target_dir),
        # Same vocabulary, unrelated weights: almost every draft token is rejected.
        "random": str(build_checkpoint(tmp_path_factory.mktemp("random-draft"), seed=7,
                                       **{**shape, "num_hidden_layers": 1})),
        # Close to the target: a mix of accepts and rejections.
        "perturbed": str(perturbed_copy(target_dir, tmp_path_factory.mktemp("perturbed-draft"), noise=0.3)),
    }


@pytest.mark.parametrize("drafter", ["none", "ngram", "self", "random", "perturbed"])
@pytest.mark.parametrize("k,policy", [(1, "fixed"), (4, "fixed"), (4, "jumping"), (4, "adaptive")])
def test_greedy_matches_target(target_dir, references, drafts, drafter, k, policy):
    engine = LocalEngine(str(target_dir), draft=drafts[drafter], num_speculative_tokens=k, kv_block_size=8,
                         adaptive=False, **self_draft_weights(drafter))
    use_policy(engine, policy) if drafter != "none" else None
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    for out, ref in zip(outputs, references):
        assert out.token_ids == ref
        assert out.finish_reason == "length"
        assert out.stats.target_forward_passes * out.stats.mean_accepted_length == pytest.approx(NEW_TOKENS)
    if drafter == "self":  # the target as its own draft: every proposed token is kept
        assert all(o.stats.acceptance_rate in (1.0, None) for o in outputs)
        assert sum(o.stats.mean_accepted_length > 1 for o in outputs) >= 3
    if drafter == "none":
        assert all(o.stats.acceptance_rate is None for o in outputs)
        assert all(o.stats.target_forward_passes == NEW_TOKENS for o in outputs)
    engine.target_worker.cache.check_accounting()
    assert engine.target_worker.cache.allocator.num_used == 0


def test_one_at_a_time_equals_batched(gqa_target_dir):
    engine = use_policy(LocalEngine(str(gqa_target_dir), draft=str(gqa_target_dir), num_speculative_tokens=3),
                        "adaptive")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    batched = [o.token_ids for o in engine.generate(PROMPTS, params)]
    alone = [engine.generate([p], params)[0].token_ids for p in PROMPTS]
    assert batched == alone


@pytest.fixture(scope="module")
def family_references(family_dir):
    return [hf_greedy(family_dir, p, NEW_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def family_drafts(family_dir, tmp_path_factory):
    return {"ngram": "ngram",
            # The same family, close to the target: a mix of accepts and rejections.
            "perturbed": str(perturbed_copy(family_dir, tmp_path_factory.mktemp("family-perturbed"), noise=0.3))}


@pytest.mark.parametrize("drafter", ["ngram", "perturbed"])
@pytest.mark.parametrize("k", [1, 4])
def test_every_family_greedy_matches_target(family_dir, family_references, family_drafts, drafter, k):
    """K fixed at its cap (adaptive=False, so K is really used) for Mistral, Qwen2 and Qwen3."""
    engine = LocalEngine(str(family_dir), draft=family_drafts[drafter], num_speculative_tokens=k, kv_block_size=8,
                         adaptive=False)
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outputs] == family_references
    assert sum(o.stats.proposed_tokens for o in outputs) > 0
    if drafter == "perturbed":
        assert 0 < sum(o.stats.accepted_tokens for o in outputs) < sum(o.stats.proposed_tokens for o in outputs)
    engine.target_worker.cache.check_accounting()


def test_draft_of_another_family(tmp_path_factory):
    """A Qwen3 target drafted by a Llama model of the same vocabulary: only vocabularies must match."""
    target = build_checkpoint(tmp_path_factory.mktemp("qwen3-target"), seed=0, **FAMILY_CONFIGS["qwen3_tied"])
    draft = build_checkpoint(tmp_path_factory.mktemp("llama-draft"), seed=5, **CONFIGS["gqa_untied"])
    engine = LocalEngine(str(target), draft=str(draft), num_speculative_tokens=3, kv_block_size=8, adaptive=False)
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outputs] == [hf_greedy(target, p, NEW_TOKENS) for p in PROMPTS]
    assert sum(o.stats.proposed_tokens for o in outputs) > 0
