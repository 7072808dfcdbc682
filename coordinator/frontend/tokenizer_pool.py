"""The one thread the public servers tokenize on.

Encoding a prompt and rendering a conversation can take milliseconds to seconds; on the server's
event loop that time would stall every other stream. They run here instead, on ONE thread with
the server's own tokenizer instance: Hugging Face fast tokenizers are not safe to share between
threads, and one thread keeps their use serial. The queue in front of it is bounded by
ServerConfig.max_waiting_requests (a request takes its waiting slot, coordinator.frontend.request_gate,
before it is tokenized), the prompt texts queued in it by max_request_bytes_in_flight (a request's
bytes stay in flight until it is tokenized), and each job by the context
(specdec.bounded_tokenize), so no request can hold the thread for more than about one context's
worth of tokenizing. A request whose client
leaves while it is queued here is cancelled before it runs.
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from coordinator.frontend.validation import prompt_ids
from specdec.bounded_tokenize import max_token_bytes


class TokenizerPool:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # used on the pool's thread only, from now on
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-tokenizer")
        # The vocabulary walk runs first on the thread; every later job finds it done.
        self._width = self._executor.submit(max_token_bytes, tokenizer) if tokenizer is not None else None

    def _prompt_ids(self, prompt, messages, max_tokens: int | None) -> list[int]:
        width = self._width.result() if self._width is not None else None
        return prompt_ids(self.tokenizer, prompt, messages, max_tokens, width)

    async def prompt_ids(self, prompt: str | Sequence[int] | None = None,
                         messages: Sequence[Mapping] | None = None, max_tokens: int | None = None) -> list[int]:
        """coordinator.frontend.validation.prompt_ids on the pool's thread; `max_tokens`: the context length
        (None while unknown), beyond which a prompt is refused without tokenizing all of it."""
        job = functools.partial(self._prompt_ids, prompt, messages, max_tokens)
        return await asyncio.get_running_loop().run_in_executor(self._executor, job)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
