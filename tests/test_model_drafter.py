"""The model drafter's bookkeeping that decides what of its cache it keeps each round, and its
sampled rows drawn in C."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draft_worker.model_drafter import choose_tokens, common_prefix_length
from specdec.model.cpu_kernels import load_cpu_kernels
from specdec.params import SamplingParams


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 200), st.lists(st.integers(0, 3), max_size=80), st.lists(st.integers(0, 3), max_size=80))
def test_common_prefix_length_is_where_two_contexts_first_differ(prefix, tail_a, tail_b):
    """Long shared prefixes and short ones, a mismatch inside the last 64 tokens or before them,
    one list a prefix of the other, either one longer, empty lists."""
    a, b = [7] * prefix + tail_a, [7] * prefix + tail_b
    expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert common_prefix_length(a, b) == expected == common_prefix_length(b, a)


@pytest.mark.skipif(load_cpu_kernels() is None, reason="no C compiler on this machine")
def test_sampled_rows_draw_the_same_tokens_and_q_in_c_as_in_torch():
    """choose_tokens' temperature and top-k rows in the model's C kernels: the same q (to float32
    rounding) and the same tokens as torch's ops, alone or beside greedy rows; a row holding a NaN
    sends the step to torch's ops."""
    kernels = load_cpu_kernels()
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(),
              SamplingParams(temperature=1.3, top_k=20, seed=2), SamplingParams(temperature=0.5, seed=3)]
    for step in range(30):
        logits = torch.randn(4, 1000, generator=gen) * 3
        contexts = [[5] * (10 + step)] * 4
        for rows in ([0], [0, 1, 2, 3], [2, 3]):
            in_c = choose_tokens(logits[rows], [params[r] for r in rows], contexts, 64, kernels=kernels)
            in_torch = choose_tokens(logits[rows], [params[r] for r in rows], contexts, 64)
            assert torch.equal(in_c[0], in_torch[0]) and in_c[1].keys() == in_torch[1].keys()
            for (ids_c, q_c), (ids_t, q_t) in zip(in_c[1].values(), in_torch[1].values()):
                assert torch.equal(ids_c, ids_t)  # (random logits: no ties)
                torch.testing.assert_close(q_c, q_t, atol=1e-6, rtol=1e-5)
    logits[0, 7] = float("nan")
    assert torch.equal(choose_tokens(logits, params, contexts, 64, kernels=kernels)[0],
                       choose_tokens(logits, params, contexts, 64)[0])
