"""Optional tokenizer loading: prompts may be token ids, so a checkpoint without one still runs."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def load_tokenizer(path: str | Path):
    """The Hugging Face tokenizer saved in a checkpoint directory, or None if there is none."""
    path = Path(path)
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def encode_prompt(tokenizer, prompt: str | Sequence[int]) -> list[int]:
    """Token ids of a prompt given as text or as ids; ValueError says what is wrong."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: send the prompt as token ids")
        ids = list(tokenizer(prompt)["input_ids"])
        if not ids:
            raise ValueError("the prompt tokenizes to no tokens")
        return ids
    return [int(t) for t in prompt]
