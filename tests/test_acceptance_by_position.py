"""scripts/acceptance_by_position.py: each draft position's acceptance at a fixed K."""
from __future__ import annotations

import sys
from pathlib import Path

from specdec.config import SHIPPED_DRAFT, SHIPPED_TARGET
from specdec.params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from acceptance_by_position import by_position  # noqa: E402

PROMPTS = [[1, 755, 2694, 1161, 7], [1, 475, 3760, 439]]
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)


def test_the_target_drafting_for_itself_is_accepted_at_every_position():
    counts, first = by_position(str(SHIPPED_TARGET), str(SHIPPED_TARGET), PROMPTS, 3, GREEDY, draft_weights="fp")
    assert all(hits == tested > 0 for hits, tested in counts)
    assert first[True] == (0, 0) and first[False][0] == first[False][1] == counts[0][1]  # (never a miss)


def test_a_position_is_tested_only_where_every_token_before_it_was_accepted():
    counts, first = by_position(str(SHIPPED_TARGET), str(SHIPPED_DRAFT), PROMPTS, 3, GREEDY)
    assert sum(a for a, _ in first.values()) == counts[0][0] and sum(t for _, t in first.values()) == counts[0][1]
    tested = [t for _, t in counts]
    assert tested[0] > 0 and all(h <= t for h, t in counts) and tested == sorted(tested, reverse=True)
    assert all(later <= hits for later, (hits, _) in zip(tested[1:], counts))  # (tested at k+1: accepted at k)
    assert any(h < t for h, t in counts)  # (the shipped draft is not its target: some rejections)
