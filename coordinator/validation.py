"""Public request -> the coordinator's Request, with errors a client can act on.

Prompt rule: a request gives a prompt as text (`prompt`), as token ids (`prompt_token_ids`, which
wins when both are given, as documented in generation.proto) or as a conversation (`messages`,
rendered with the model's chat template), and `messages` excludes the other two. Text and chat are
tokenized with the server's tokenizer exactly as LocalEngine does (specdec.tokenizer). Limits that
need the model (context length, vocabulary, KV blocks) are the scheduler's to check, when the
request is added. The HTTP API (coordinator.openai_requests) builds its requests with the same
functions, so both front doors reject the same input with the same messages.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from coordinator.request import Request
from specdec import wire
from specdec.params import SamplingParams
from specdec.tokenizer import encode_prompt, render_chat
from specdec.v1 import generation_pb2


def prompt_ids(tokenizer, prompt: str | Sequence[int] | None = None,
               messages: Sequence[Mapping] | None = None) -> list[int]:
    """Token ids of a text / token-id prompt or of a conversation; ValueError names the field."""
    if messages is not None:
        if prompt:
            raise ValueError("give either messages or a prompt (prompt / prompt_token_ids), not both")
        return render_chat(tokenizer, messages)
    ids = encode_prompt(tokenizer, prompt) if prompt is not None else []
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def new_request(req_id: str, ids: list[int], params: SamplingParams, num_speculative_tokens: int | None = None,
                time_remaining: float | None = None) -> Request:
    """`time_remaining`: the call's deadline in seconds from now (None: no deadline)."""
    deadline = time.monotonic() + time_remaining if time_remaining is not None else None
    return Request(req_id=req_id, prompt_ids=ids, params=params, num_speculative_tokens=num_speculative_tokens,
                   deadline=deadline)


def request_from_proto(message: generation_pb2.GenerateRequest, tokenizer, req_id: str,
                       time_remaining: float | None) -> Request:
    """Raises ValueError naming the bad field. `time_remaining`: the call's deadline, seconds."""
    params, num_speculative_tokens = wire.params_from_generate_request(message)
    prompt = list(message.prompt_token_ids) or message.prompt
    messages = [{"role": m.role, "content": m.content} for m in message.messages] or None
    return new_request(req_id, prompt_ids(tokenizer, prompt, messages), params, num_speculative_tokens,
                       time_remaining)
