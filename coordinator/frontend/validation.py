"""Public request -> the coordinator's Request, with errors a client can act on.

Prompt rule: a request gives a prompt as text (`prompt`), as token ids (`prompt_token_ids`, which
wins when both are given, as documented in generation.proto) or as a conversation (`messages`,
rendered with the model's chat template), and `messages` excludes the other two. Text and chat are
tokenized with the server's tokenizer exactly as LocalEngine does (specdec.tokenizer). Limits that
need the model (context length, vocabulary, KV blocks) are the scheduler's to check, when the
request is added. The HTTP API (coordinator.frontend.openai_requests) builds its requests with the same
functions, so both front doors reject the same input with the same messages.

The servers tokenize on their tokenizer thread (coordinator.frontend.tokenizer_pool) and give
`max_tokens`, the context length: a prompt that cannot fit is then refused at a cost bounded by
the context, not by its size (specdec.bounded_tokenize).
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from coordinator.rounds.request import Request
from specdec.bounded_tokenize import PromptTooLong
from specdec.params import SamplingParams
from specdec.tokenizer import encode_prompt, render_chat
from specdec.v1 import generation_pb2


def prompt_ids(tokenizer, prompt: str | Sequence[int] | None = None, messages: Sequence[Mapping] | None = None,
               max_tokens: int | None = None, token_width: int | None = None) -> list[int]:
    """Token ids of a text / token-id prompt or of a conversation; ValueError names the field.
    `max_tokens` / `token_width`: see specdec.tokenizer.encode_prompt."""
    if messages is not None:
        if prompt:
            raise ValueError("give either messages or a prompt (prompt / prompt_token_ids), not both")
        return render_chat(tokenizer, messages, max_tokens, token_width)
    check_token_ids(prompt, max_tokens)
    ids = encode_prompt(tokenizer, prompt, max_tokens, token_width) if prompt is not None else []
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def check_token_ids(prompt, max_tokens: int | None) -> None:
    """O(1): a prompt of token ids longer than the context length is refused before it is copied."""
    if max_tokens is not None and prompt is not None and not isinstance(prompt, str) and len(prompt) > max_tokens:
        raise PromptTooLong(f"the prompt ({len(prompt)} token ids) is longer than the context length "
                            f"({max_tokens} tokens)")


def new_request(req_id: str, ids: list[int], params: SamplingParams, num_speculative_tokens: int | None = None,
                time_remaining: float | None = None) -> Request:
    """`time_remaining`: the call's deadline in seconds from now (None: no deadline)."""
    deadline = time.monotonic() + time_remaining if time_remaining is not None else None
    return Request(req_id=req_id, prompt_ids=ids, params=params, num_speculative_tokens=num_speculative_tokens,
                   deadline=deadline)


def prompt_from_proto(message: generation_pb2.GenerateRequest, max_tokens: int | None = None):
    """(prompt, messages) of a public request, for prompt_ids; O(context length) at most."""
    check_token_ids(message.prompt_token_ids, max_tokens)
    prompt = list(message.prompt_token_ids) or message.prompt
    if max_tokens is not None and len(message.messages) > max_tokens:
        raise PromptTooLong(f"{len(message.messages)} messages cannot fit the context length ({max_tokens} tokens)")
    messages = [{"role": m.role, "content": m.content} for m in message.messages] or None
    return prompt, messages

