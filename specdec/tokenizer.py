"""Optional tokenizer loading: prompts may be token ids, so a checkpoint without one still runs."""
from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: str | Path):
    """The Hugging Face tokenizer saved in a checkpoint directory, or None if there is none."""
    path = Path(path)
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
