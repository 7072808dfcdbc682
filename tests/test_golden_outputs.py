"""Golden outputs of the shipped pair: refactors must leave every generated token unchanged.

`tests/golden/shipped_pair.json` holds the token ids LocalEngine produced for a few held-out
prompts, greedy and seeded-sampled, with each drafter. A change that alters them on purpose (a new
randomness design, a new model) regenerates the file with

    SPECDEC_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden_outputs.py

and says why in its commit message.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from specdec import LocalEngine, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden" / "shipped_pair.json"
PROMPT_LINES = (0, 37, 81)
MAX_NEW_TOKENS = 24

CASES = {
    # name: (draft, SamplingParams keyword arguments)
    "plain-greedy": (None, dict(temperature=0.0)),
    "draft-greedy": ("draft", dict(temperature=0.0)),
    "ngram-greedy": ("ngram", dict(temperature=0.0)),
    "plain-sampled": (None, dict(temperature=0.8, seed=11)),
    "draft-sampled": ("draft", dict(temperature=0.8, seed=11)),
    "ngram-sampled": ("ngram", dict(temperature=0.8, seed=11)),
    "draft-filters": ("draft", dict(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.2, seed=5)),
}


def _prompts() -> list[str]:
    lines = (ROOT / "models" / "heldout_prompts.jsonl").read_text().splitlines()
    return [json.loads(lines[i])["prompt"] for i in PROMPT_LINES]


@pytest.fixture(scope="module")
def engines():
    target = str(ROOT / "models" / "target")
    drafts = {None: None, "draft": str(ROOT / "models" / "draft"), "ngram": "ngram"}
    # K fixed: the golden tokens pin the runtime and the randomness, not the policy's choices.
    return {name: LocalEngine(target, draft=path, num_speculative_tokens=5, adaptive=False)
            for name, path in drafts.items()}


def _generate(engines, case: str) -> list[list[int]]:
    draft, kwargs = CASES[case]
    # Seeded cases give each prompt its own stream: seed, seed + 1, ...
    params = [SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True,
                             **{**kwargs, **({"seed": kwargs["seed"] + i} if "seed" in kwargs else {})})
              for i in range(len(PROMPT_LINES))]
    return [out.token_ids for out in engines[draft].generate(_prompts(), params)]


def test_golden_outputs_unchanged(engines):
    produced = {case: _generate(engines, case) for case in CASES}
    if os.environ.get("SPECDEC_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        rows = ",\n".join(f"  {json.dumps(case)}: {json.dumps(produced[case])}" for case in CASES)
        GOLDEN.write_text("{\n" + rows + "\n}\n")
        pytest.skip(f"rewrote {GOLDEN}")
    expected = json.loads(GOLDEN.read_text())
    assert sorted(expected) == sorted(CASES)
    for case in CASES:
        assert produced[case] == expected[case], f"{case}: output differs from the golden tokens"


def test_greedy_golden_outputs_agree_across_drafters():
    """Speculation never changes greedy output: every drafter's golden tokens are plain decoding's."""
    expected = json.loads(GOLDEN.read_text())
    assert expected["draft-greedy"] == expected["plain-greedy"] == expected["ngram-greedy"]
