"""Incremental detokenisation with stop strings, on committed tokens only.

Text is released only when it is final: a trailing partial UTF-8 character ("\\ufffd") waits for
its next byte, and a suffix that could still grow into a stop string waits until it cannot, so a
client never receives text that a later stop string would have cut. The text is decoded a tail at a
time where that gives the whole decode's text (coordinator.rounds.tail_decoder).
"""
from __future__ import annotations

from coordinator.rounds.tail_decoder import TailDecoder


def held_back_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class TextStream:
    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.decoder = TailDecoder(tokenizer) if tokenizer is not None else None
        self.stops = stops
        self.token_ids: list[int] = []
        self.sent = 0  # characters of the full text already released

    def _text(self) -> str:
        """The text of all tokens so far (self.token_ids only grow, as TailDecoder needs)."""
        return self.decoder.text(self.token_ids) if self.decoder is not None else ""

    def add(self, new_ids: list[int]) -> tuple[list[int], str, bool]:
        """Append committed tokens. Returns (tokens kept, text to release now, stop hit).

        On a stop string, the tokens after the one that completed it are dropped and the text is
        cut before the stop string itself.
        """
        if self.tokenizer is None or not new_ids:
            self.token_ids.extend(new_ids)
            return list(new_ids), "", False
        kept: list[int] = []
        for token in new_ids:
            kept.append(token)
            self.token_ids.append(token)
            if self.stops:
                text = self._text()
                # Only the tail can contain a new match: earlier text was already checked.
                window = max(0, self.sent - max(len(s) for s in self.stops))
                hits = [i for i in (text.find(s, window) for s in self.stops) if i >= 0]
                if hits:
                    cut = min(hits)
                    release = text[self.sent:cut] if cut > self.sent else ""
                    self.sent = max(self.sent, cut)
                    return kept, release, True
        return kept, self._release(final=False), False

    def _release(self, final: bool) -> str:
        text = self._text()
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):
                end = len(text.rstrip("\ufffd"))
            end -= held_back_suffix(text[:end], self.stops)
        if end <= self.sent:
            return ""
        out = text[self.sent:end]
        self.sent = end
        return out

    def finish(self) -> str:
        """Everything still held back, once no more tokens will come."""
        if self.tokenizer is None:
            return ""
        return self._release(final=True)

    @property
    def text(self) -> str:
        return self._text()
