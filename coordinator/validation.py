"""Public request -> the coordinator's Request, with errors a client can act on.

Prompt rule: a non-empty `prompt_token_ids` wins and `prompt` is then ignored (as documented in
generation.proto); otherwise `prompt` is tokenized with the server's tokenizer exactly as
LocalEngine does. Both empty is an error. Limits that need the model (context length, vocabulary,
KV blocks) are the scheduler's to check, when the request is added.
"""
from __future__ import annotations

import time

from coordinator.request import Request
from specdec import wire
from specdec.tokenizer import encode_prompt
from specdec.v1 import generation_pb2


def request_from_proto(message: generation_pb2.GenerateRequest, tokenizer, req_id: str,
                       time_remaining: float | None) -> Request:
    """Raises ValueError naming the bad field. `time_remaining`: the call's deadline, seconds."""
    params, num_speculative_tokens = wire.params_from_generate_request(message)
    prompt = list(message.prompt_token_ids) or message.prompt
    prompt_ids = encode_prompt(tokenizer, prompt)
    deadline = time.monotonic() + time_remaining if time_remaining is not None else None
    return Request(req_id=req_id, prompt_ids=prompt_ids, params=params,
                   num_speculative_tokens=num_speculative_tokens, deadline=deadline)
