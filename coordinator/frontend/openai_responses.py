"""OpenAI's response shapes: whole bodies, streamed chunks and usage, for completions and chat."""
from __future__ import annotations

import time
import uuid

from coordinator.rounds.request import RequestStats

# The scheduler's finish reasons in OpenAI's words: EOS and a stop string are both "stop".
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(stats: RequestStats | None, prompt_tokens: int) -> dict:
    completion = stats.generated if stats is not None else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


class ResponseShape:
    """Builds one endpoint's bodies and chunks: `chat` False = text_completion, True = chat."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self, text: str, finish_reason: str | None, usage_: dict) -> dict:
        """The whole (non-streamed) response."""
        reason = FINISH_REASONS.get(finish_reason or "", finish_reason)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
            return {**self._base("chat.completion"), "choices": [choice], "usage": usage_}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {**self._base("text_completion"), "choices": [choice], "usage": usage_}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
        """One streamed delta; finish_reason stays null until the last."""
        reason = FINISH_REASONS.get(finish_reason, finish_reason) if finish_reason else None
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return {**self._base("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage_: dict) -> dict:
        """The last chunk when stream_options.include_usage is set: usage and no choices."""
        return {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage_}
