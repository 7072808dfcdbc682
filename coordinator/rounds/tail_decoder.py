"""A response's text decoded a tail at a time, always equal to decoding all its tokens at once.

Decoding every committed token again each round costs O(length) a round and O(length^2) a
response (the shipped tokenizer: ~0.1 ms for 256 tokens, ~0.9 ms for 2,048, per request and round).
A byte-level BPE tokenizer (tokenizers' ByteLevel decoder: Llama 3, Qwen2, GPT-2, SmolLM) decodes
by joining the bytes of every kept token and reading them as UTF-8 once, malformed bytes replaced.
So decode(a + b) == decode(a) + decode(b) whenever decode(a) ends on a whole character, that is,
not in U+FFFD: after a complete character the UTF-8 reader starts afresh. TailDecoder keeps the
text of the tokens up to the last such point (the anchor) and decodes only the tokens after it.
Other decoders are decoded whole each time, as before: SentencePiece's strips the first space of
the whole text, and transformers' clean_up_tokenization_spaces joins across tokens (" ." -> ".").
"""
from __future__ import annotations

import weakref

# Text that clean_up_tokenization_spaces would change: a tokenizer whose decode of it differs from
# its backend's does something to the joined text that a split decode would not repeat.
CLEANUP_PROBE = "a . b , c ! d ? e 's f n't g 'm h 've i 're j"

_splits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decodes_in_pieces(tokenizer) -> bool:
    """Whether `tokenizer.decode` joins per-token bytes as UTF-8 and nothing else (see above)."""
    try:
        return _splits[tokenizer]
    except (KeyError, TypeError):
        pass
    from tokenizers import decoders  # deferred: only tokenizers that are used need it
    backend = getattr(tokenizer, "backend_tokenizer", None)
    answer = backend is not None and isinstance(backend.decoder, decoders.ByteLevel)
    if answer:
        probe = tokenizer.encode(CLEANUP_PROBE, add_special_tokens=False)
        answer = (tokenizer.decode(probe, skip_special_tokens=True)
                  == backend.decode(probe, skip_special_tokens=True))
    try:
        _splits[tokenizer] = answer
    except TypeError:  # not weakly referable: asked again next time (a few tokens' work)
        pass
    return answer


class TailDecoder:
    """decode(ids, skip_special_tokens=True) for one growing list of token ids."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.in_pieces = decodes_in_pieces(tokenizer)
        self.anchor = 0  # tokens whose text is `head`; their text ends on a whole character
        self.head = ""

    def text(self, ids: list[int]) -> str:
        """The text of `ids`, which extend the ids of every earlier call (only ever appended to)."""
        if not self.in_pieces:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        tail = self.tokenizer.decode(ids[self.anchor:], skip_special_tokens=True)
        if tail.endswith("\ufffd"):  # maybe half a character: its next bytes may complete it
            return self.head + tail
        self.head += tail
        self.anchor = len(ids)
        return self.head
