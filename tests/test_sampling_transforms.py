"""Logits transforms: agreement with Hugging Face's processors, presence masks, sparsification."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec.params import SamplingParams
from specdec.sampling import (
    BatchSamplingParams,
    apply_repetition_penalty,
    presence_for_positions,
    presence_mask,
    probs_from_logits,
    top_entries,
)


def hf_probs(logits_row: torch.Tensor, tokens: list[int], sp: SamplingParams) -> torch.Tensor:
    """Reference: HF's own processors applied to one row, in generate()'s order."""
    ids = torch.tensor([tokens], dtype=torch.long)
    scores = logits_row[None].float().clone()
    if sp.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(float(sp.repetition_penalty))(ids, scores)
    if sp.greedy:
        return torch.zeros_like(scores[0]).scatter_(0, scores[0].argmax()[None], 1.0)
    scores = TemperatureLogitsWarper(float(sp.temperature))(ids, scores)
    if sp.top_k > 0:
        scores = TopKLogitsWarper(sp.top_k)(ids, scores)
    if sp.top_p < 1.0:
        scores = TopPLogitsWarper(sp.top_p)(ids, scores)
    return torch.softmax(scores, dim=-1)[0]


def random_case(n: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=g))]  # noqa: E731
    params = [
        SamplingParams(
            temperature=pick([0.0, 0.3, 0.7, 1.0, 1.8]),
            top_k=pick([0, 0, 1, 3, 10, 200]),
            top_p=pick([1.0, 1.0, 0.95, 0.6, 0.2, 0.01]),
            repetition_penalty=pick([1.0, 1.0, 1.3, 2.0, 0.7]),
        )
        for _ in range(n)
    ]
    tokens = [torch.randint(vocab, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
              for _ in range(n)]
    logits = torch.randn(n, vocab, generator=g) * 3
    return logits, tokens, params


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_huggingface_row_by_row(seed):
    vocab = 64
    logits, tokens, params = random_case(48, vocab, seed)
    probs = probs_from_logits(logits, BatchSamplingParams.from_params(params), presence_mask(tokens, vocab, "cpu"))
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    for i, sp in enumerate(params):
        expected = hf_probs(logits[i], tokens[i], sp)
        torch.testing.assert_close(probs[i], expected, atol=1e-6, rtol=1e-5, msg=f"row {i}: {sp}")


def test_repetition_penalty_matches_hf_and_returns_new_tensor():
    logits, tokens, _ = random_case(8, 32, seed=5)
    before = logits.clone()
    penalty = torch.tensor([1.0, 1.5, 0.5, 2.0, 1.2, 3.0, 0.9, 1.1])
    out = apply_repetition_penalty(logits, presence_mask(tokens, 32), penalty)
    assert torch.equal(logits, before)
    for i in range(8):
        ref = RepetitionPenaltyLogitsProcessor(float(penalty[i]))(torch.tensor([tokens[i]]), logits[i : i + 1].clone())
        torch.testing.assert_close(out[i], ref[0])


def test_greedy_rows_are_exact_one_hot_and_filters_disable():
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(3))
    params = BatchSamplingParams.from_params(
        [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=1),
         SamplingParams(temperature=1.0, top_p=1e-6)]
    )
    probs = probs_from_logits(logits, params)
    onehot = torch.zeros(20).scatter_(0, logits[0].argmax()[None], 1.0)
    assert torch.equal(probs[0], onehot)
    torch.testing.assert_close(probs[1], torch.softmax(logits[1], -1))  # top_k=0, top_p=1: plain softmax
    for row in (2, 3):  # both filters keep at least the top token
        assert probs[row].argmax() == logits[row].argmax() and probs[row].max() == 1.0
    assert params.greedy.tolist() == [True, False, False, False]


def test_top_k_keeps_ties_like_hf():
    logits = torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0]])
    probs = probs_from_logits(logits, BatchSamplingParams.from_params([SamplingParams(temperature=1.0, top_k=2)]))
    torch.testing.assert_close(probs[0], torch.tensor([1 / 3, 0, 1 / 3, 0, 1 / 3]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_logits_computed_in_float32(dtype):
    logits, tokens, params = random_case(16, 40, seed=9)
    low = logits.to(dtype)
    bp = BatchSamplingParams.from_params(params)
    pres = presence_mask(tokens, 40)
    probs = probs_from_logits(low, bp, pres)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, probs_from_logits(low.float(), bp, pres))


def test_from_params_one_row_per_position():
    params = [SamplingParams(temperature=0.5, top_k=3), SamplingParams(top_p=0.5, repetition_penalty=1.2)]
    r = BatchSamplingParams.from_params([p for p, n in zip(params, [2, 3]) for _ in range(n)])
    assert r.temperature.tolist() == [0.5, 0.5, 0.0, 0.0, 0.0]
    assert r.top_k.tolist() == [3, 3, 0, 0, 0] and r.top_k.dtype == torch.int64
    assert r.top_p.tolist() == [1.0, 1.0, 0.5, 0.5, 0.5]
    torch.testing.assert_close(r.repetition_penalty, torch.tensor([1.0, 1.0, 1.2, 1.2, 1.2]))
    assert (r.any_greedy, r.all_greedy, r.any_top_k, r.any_top_p) == (True, False, True, False)


def test_a_steady_batch_reuses_its_parameter_tensors():
    """Rows that keep their parameters (a steady batch, step after step) get the tensors built for
    them the first time (4 tensors cost ~30 us a step); other values get their own."""
    batch = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.5, top_k=4, seed=2)]
    first = BatchSamplingParams.from_params(batch)
    assert BatchSamplingParams.from_params([dataclasses.replace(p, seed=9) for p in batch]) is first  # (seeds aside)
    other = BatchSamplingParams.from_params([batch[0], dataclasses.replace(batch[1], top_p=0.9)])
    assert other is not first and other.any_top_p and not first.any_top_p
    assert other.top_p.tolist() == pytest.approx([1.0, 0.9]) and first.top_p.tolist() == [1.0, 1.0]


def test_presence_mask():
    m = presence_mask([[1, 3, 3], [], [0]], 5)
    assert m.tolist() == [[False, True, False, True, False], [False] * 5, [True, False, False, False, False]]


def test_presence_for_positions_matches_loop():
    g = torch.Generator().manual_seed(11)
    B, K, V = 5, 4, 12
    base = torch.rand(B, V, generator=g) < 0.2
    draft = torch.randint(V, (B, K), generator=g)
    num_proposed = torch.tensor([0, 1, 4, 2, 3])
    draft[0] = -1  # padding may hold anything; it must never be read
    out = presence_for_positions(base, draft, num_proposed)
    assert out.shape == (B, K + 1, V)
    for b in range(B):
        for i in range(K + 1):
            expected = base[b].clone()
            for j in range(min(i, int(num_proposed[b]))):
                expected[draft[b, j]] = True
            assert torch.equal(out[b, i], expected), (b, i)
    assert torch.equal(presence_for_positions(base, draft[:, :0], num_proposed * 0)[:, 0], base)


def test_penalty_with_positions_makes_draft_and_target_agree():
    """The draft penalises token i with earlier drafted tokens; the target, scoring all positions at
    once with presence_for_positions, must produce the same distribution for the same logits."""
    g = torch.Generator().manual_seed(4)
    V, K = 16, 3
    logits = torch.randn(K + 1, V, generator=g)
    history = [2, 5]
    params = BatchSamplingParams.from_params([SamplingParams(temperature=0.9, repetition_penalty=1.8)])
    drafted: list[int] = []
    for i in range(K + 1):
        q_i = probs_from_logits(logits[i : i + 1], params, presence_mask([history + drafted], V))
        if i < K:
            drafted.append(int(torch.multinomial(q_i[0], 1, generator=g)))
        pres = presence_for_positions(presence_mask([history], V), torch.tensor([drafted + [0] * (K - len(drafted))]),
                                      torch.tensor([K]))
        p_i = probs_from_logits(logits[i : i + 1], params, pres[:, i])
        torch.testing.assert_close(p_i, q_i)


def test_top_entries_keep_the_largest_and_renormalise():
    probs = torch.softmax(torch.randn(6, 30, generator=torch.Generator().manual_seed(2)), -1)
    ids, vals = top_entries(probs, 4)
    assert ids.shape == vals.shape == (6, 4)
    torch.testing.assert_close(vals.sum(-1), torch.ones(6))
    top = probs.topk(4, -1)
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(vals, top.values / top.values.sum(-1, keepdim=True))
    every_id, every = top_entries(probs, 100)  # more entries than the vocabulary: all of them
    assert torch.equal(every_id[0], torch.arange(30))
    torch.testing.assert_close(every, probs)


def test_disabled_transforms_are_skipped_but_give_the_same_distribution():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(9)) * 2
    plain = [SamplingParams(temperature=0.7)] * 4
    reference = BatchSamplingParams.from_params(plain)
    forced = dataclasses.replace(reference, any_greedy=True, any_top_k=True, any_top_p=True)  # every path runs
    torch.testing.assert_close(probs_from_logits(logits, reference), probs_from_logits(logits, forced))
    only_k = BatchSamplingParams.from_params([SamplingParams(temperature=0.7, top_k=5)] * 4)
    assert not only_k.any_top_p
    torch.testing.assert_close(probs_from_logits(logits, only_k),
                               probs_from_logits(logits, dataclasses.replace(only_k, any_top_p=True)))
