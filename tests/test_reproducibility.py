"""A seeded request returns the same tokens every time: alone or inside a busy batch, on a quiet
or a loaded machine, with workers that answer late, with the adaptive policy choosing K.

Every random draw is a function of (seed, token position, purpose), and a seeded request's K
depends on its own history only, so nothing about the schedule can reach its tokens."""
from __future__ import annotations

import random
import subprocess
import sys

import pytest

from specdec import LocalEngine, SamplingParams

from checkpoints import CONFIGS, SlowWorker, build_checkpoint, cheap_drafting_policy, perturbed_copy

PROMPTS = [[3, 17, 42, 7, 99, 12, 5], [8, 8, 8, 21, 30, 8, 8, 8, 21], [150, 4], list(range(40, 60))]
SEEDED = [SamplingParams(max_new_tokens=20, temperature=0.9, seed=7 + i, ignore_eos=True) for i in range(4)]
SEEDED[3] = SamplingParams(max_new_tokens=20, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.2,
                           seed=2**64 - 1, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = build_checkpoint(tmp_path_factory.mktemp("repro-target"), seed=0, initializer_range=0.1,
                              **CONFIGS["gqa_untied"])
    draft = perturbed_copy(target, tmp_path_factory.mktemp("repro-draft"), noise=0.2)
    return str(target), str(draft)


def engine(models, policy_chosen: list[int] | None = None) -> LocalEngine:
    target, draft = models
    eng = LocalEngine(target, draft=draft, num_speculative_tokens=4, max_batch_size=16, adaptive=False)
    eng.scheduler.policy = cheap_drafting_policy()  # the real policy, on costs where drafting pays
    if policy_chosen is not None:
        eng.on_round = lambda report: policy_chosen.extend(u.num_speculative_tokens for u in report.updates)
    return eng


def test_seeded_requests_are_the_same_alone_in_a_busy_batch_and_under_load(models):
    chosen: list[int] = []
    alone = [engine(models, chosen).generate([p], [sp])[0].token_ids for p, sp in zip(PROMPTS, SEEDED)]
    assert len(set(chosen)) >= 3, f"the policy should have moved K, chose {sorted(set(chosen))}"

    busy = engine(models)
    rng = random.Random(5)
    busy.scheduler.draft = SlowWorker(busy.scheduler.draft, rng, "propose")
    busy.scheduler.target = SlowWorker(busy.scheduler.target, rng, "verify")
    company = [SamplingParams(max_new_tokens=rng.randrange(5, 30), temperature=rng.choice([0.0, 0.5, 1.3]),
                              seed=None if i % 2 else 1000 + i, ignore_eos=True) for i in range(8)]
    company_prompts = [[rng.randrange(300) for _ in range(rng.randrange(1, 15))] for _ in company]
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a loaded machine
    try:
        # The seeded requests in the middle of the batch, their positions shuffled.
        order = list(range(len(company) + len(SEEDED)))
        rng.shuffle(order)
        prompts = company_prompts + PROMPTS
        params = company + SEEDED
        outs = busy.generate([prompts[i] for i in order], [params[i] for i in order])
    finally:
        burner.kill()
        burner.wait()
    together = {order[j]: out.token_ids for j, out in enumerate(outs)}
    assert [together[len(company) + i] for i in range(len(SEEDED))] == alone


def test_one_seed_gives_one_output_and_the_top_bit_matters(models):
    eng = engine(models)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=12345, ignore_eos=True)
    first = eng.generate([PROMPTS[0]], [params])[0].token_ids
    assert eng.generate([PROMPTS[0]], [params])[0].token_ids == first
    flipped = SamplingParams(max_new_tokens=16, temperature=1.0, seed=12345 | 1 << 63, ignore_eos=True)
    assert eng.generate([PROMPTS[0]], [flipped])[0].token_ids != first
