"""Tokenizing text that may be far longer than the context, at a cost bounded by the context.

A prompt that cannot fit must be rejected without tokenizing all of it: a hostile client's 4 MiB
prompt would otherwise hold the tokenizer thread for seconds. Two bounds, cheapest first:

- *Token width*: the most input bytes one token can stand for, read once from the vocabulary
  (`max_token_bytes`). A text of more than max_tokens * width characters (each character is at
  least one byte) needs more than max_tokens tokens: rejected in O(1). It holds for byte-level
  BPE and for BPE over characters without fused unknowns (Llama, Mistral, Qwen, GPT-2 style);
  for other tokenizers (WordPiece, Unigram, fused <unk>: one token may cover a whole run of text)
  `max_token_bytes` is None and only the next bound applies.
- *Counting in chunks*: a long text is tokenized CHUNK_CHARS at a time, cut at whitespace, and
  counting stops as soon as the chunks' tokens, less BOUNDARY_SLACK per cut (a cut can split what
  the whole text would have merged), exceed max_tokens. The work done is then proportional to
  max_tokens, not to the text. A text that passes is tokenized once more, whole, so that its ids
  are exactly what the tokenizer gives the whole text.
"""
from __future__ import annotations

CHUNK_CHARS = 16_384
BOUNDARY_SLACK = 8  # tokens a cut between two chunks may add at most


class PromptTooLong(ValueError):
    """The text needs more tokens than allowed; the message says by which bound."""


def max_token_bytes(tokenizer) -> int | None:
    """The most input bytes one token of `tokenizer` stands for, or None where no such bound
    holds (see the module docstring). Walks the vocabulary once: call it once per tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if model is None or type(model).__name__ != "BPE" or (model.unk_token and model.fuse_unk):
        return None
    # Byte-level BPE writes each input byte as one character (Ġ for a space); elsewhere a token's
    # text is its input, except that "▁" (3 bytes) or "<0x0A>" stand for one byte: over-counting
    # only loosens the bound.
    byte_level = "ByteLevel" in repr(backend.pre_tokenizer) or "ByteLevel" in repr(backend.decoder)
    width = max((len(t) if byte_level else len(t.encode("utf-8")) for t in tokenizer.get_vocab()), default=1)
    return max(width, 4)  # an unknown character becomes one token: up to 4 UTF-8 bytes


def check_width(chars: int, max_tokens: int, width: int | None, what: str = "the prompt") -> None:
    """O(1): PromptTooLong if `chars` characters must tokenize to more than max_tokens tokens."""
    if width is not None and chars > max_tokens * width:
        raise PromptTooLong(f"{what} ({chars} characters) cannot fit the context length ({max_tokens} tokens): "
                            f"this tokenizer's tokens cover at most {width} bytes each, so more than "
                            f"{max_tokens * width} characters never fit")


def _cuts(text: str) -> list[int]:
    """Chunk ends: every CHUNK_CHARS characters, moved back to just before a whitespace if one is
    in the second half of the chunk (byte-level BPE attaches a space to the word after it)."""
    ends, start = [], 0
    while len(text) - start > CHUNK_CHARS:
        end = start + CHUNK_CHARS
        space = max(text.rfind(" ", start + CHUNK_CHARS // 2, end), text.rfind("\n", start + CHUNK_CHARS // 2, end))
        end = space if space > start else end
        ends.append(end)
        start = end
    return ends + [len(text)]


def encode_within(tokenizer, text: str, max_tokens: int, width: int | None, add_special_tokens: bool = True,
                  what: str = "the prompt") -> list[int]:
    """The token ids of `text` as `tokenizer(text)` gives them; PromptTooLong, after no more work
    than about max_tokens tokens' worth, if the text has clearly more than max_tokens."""
    check_width(len(text), max_tokens, width, what)
    if len(text) > CHUNK_CHARS:
        counted, start = 0, 0
        for cuts, end in enumerate(_cuts(text)):
            counted += len(tokenizer(text[start:end], add_special_tokens=False)["input_ids"])
            start = end
            if counted - BOUNDARY_SLACK * cuts > max_tokens:
                raise PromptTooLong(f"{what} is longer than the context length ({max_tokens} tokens): more "
                                    f"than that in its first {end} of {len(text)} characters")
    # Whole, about max_tokens tokens or fewer; an exact excess is the scheduler's to report.
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
