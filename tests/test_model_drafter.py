"""The model drafter's bookkeeping that decides what of its cache it keeps each round."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from draft_worker.model_drafter import common_prefix_length


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 200), st.lists(st.integers(0, 3), max_size=80), st.lists(st.integers(0, 3), max_size=80))
def test_common_prefix_length_is_where_two_contexts_first_differ(prefix, tail_a, tail_b):
    """Long shared prefixes and short ones, a mismatch inside the last 64 tokens or before them,
    one list a prefix of the other, either one longer, empty lists."""
    a, b = [7] * prefix + tail_a, [7] * prefix + tail_b
    expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert common_prefix_length(a, b) == expected == common_prefix_length(b, a)
