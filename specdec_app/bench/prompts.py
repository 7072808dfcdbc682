"""The bench's prompts: n of them spread over a JSONL file, as token ids (tokenized once, up front,
the way LocalEngine encodes text), and batches of them.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from specdec.tokenizer import encode_prompt


def prompt_entries(path: str | Path) -> list[dict]:
    """The JSONL file's prompts: one entry per non-blank line."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def load_prompts(path: str | Path, n: int, tokenizer=None) -> tuple[list[list[int]], list[str]]:
    """n prompts spread evenly over a JSONL file of {"prompt": text} or {"prompt_ids": [ids]}.

    Returns (token-id lists, a short description of each). Text needs the checkpoint's tokenizer
    and is encoded the way LocalEngine encodes it.
    """
    entries = prompt_entries(path)
    if not entries:
        raise ValueError(f"{path}: no prompts")
    if n > len(entries):
        raise ValueError(f"asked for {n} prompts but {path} has {len(entries)}")
    picks = [entries[(i * len(entries)) // n] for i in range(n)]
    ids, names = [], []
    for i, entry in enumerate(picks):
        if "prompt_ids" in entry:
            ids.append([int(t) for t in entry["prompt_ids"]])
        elif "prompt" in entry:
            ids.append(encode_prompt(tokenizer, entry["prompt"]))
        else:
            raise ValueError(f"{path}: every line needs \"prompt\" or \"prompt_ids\"")
        names.append(str(entry.get("source", f"prompt {i}")))
    if any(not p for p in ids):
        raise ValueError(f"{path}: empty prompt")
    return ids, names


def chunks(items: Sequence, size: int) -> list[Sequence]:
    return [items[i:i + size] for i in range(0, len(items), size)]
