"""Optional tokenizer loading: prompts may be token ids, so a model without a tokenizer still runs."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from specdec.model.source import resolve_model_source


def load_tokenizer(spec: str | Path):
    """The tokenizer of the model `spec` names (checkpoint directory, .gguf file or Hub id: see
    specdec.model.source), or None if it has none. Its `chat_template` is the model's chat
    template (None without one), ready for `tokenizer.apply_chat_template`."""
    return resolve_model_source(str(spec)).tokenizer()


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
