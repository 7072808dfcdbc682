"""OpenAI's request shapes for /v1/completions and /v1/chat/completions, and their conversion
into the coordinator's Request.

Requests are parsed leniently, as OpenAI's own server does: fields this service does not
implement (logprobs, presence_penalty, user, tools, ...) are ignored. Values are checked by the
same code as the gRPC API's (SamplingParams, specdec.tokenizer via coordinator.frontend.validation), so a
bad value gets the same message on both. Defaults where this service differs from OpenAI's:
max_tokens 64 (the gRPC API's default, for completions and chat alike); temperature is OpenAI's 1.0.
`top_k` and `repetition_penalty` are extensions (as in vLLM).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from coordinator.frontend.openai_errors import OpenAIError, invalid
from coordinator.frontend.request_limits import RequestLimits
from coordinator.frontend.tokenizer_pool import TokenizerPool
from coordinator.frontend.validation import new_request
from coordinator.rounds.request import Request
from specdec.params import SamplingParams

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; the gRPC API's is greedy


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    def max_tokens_given(self) -> tuple[int | None, str]:
        """(the requested output length, the field that gave it)."""
        return self.max_tokens, "max_tokens"

    def sampling_params(self, limits: RequestLimits) -> SamplingParams:
        """Raises OpenAIError (400) naming the field."""
        try:
            limits.check_stops(self.stop)
        except ValueError as e:
            raise invalid(str(e), "stop") from None
        if self.n not in (None, 1):
            raise OpenAIError(400, f"n must be 1 (this server returns one choice per request), got {self.n}", "n")
        max_tokens, field = self.max_tokens_given()
        if max_tokens is not None and max_tokens < 1:
            raise OpenAIError(400, f"{field} must be a positive integer, got {max_tokens}", field)
        kwargs: dict = {"temperature": DEFAULT_TEMPERATURE if self.temperature is None else self.temperature}
        if max_tokens is not None:
            kwargs["max_new_tokens"] = max_tokens
        for name in ("top_p", "top_k", "repetition_penalty", "seed"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.stop is not None:
            kwargs["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise invalid(str(e)) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    prompt_field: ClassVar[str] = "prompt"  # the field tokenizing errors name

    def prompt_input(self) -> tuple[str | list[int], None]:
        """(prompt, messages) for TokenizerPool.prompt_ids."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            raise OpenAIError(400, "prompt must be one string or one list of token ids: batches of prompts "
                                   "are not supported (send one request per prompt)", "prompt")
        return prompt, None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict] | None = None

    def text(self, index: int) -> str:
        """The content as text: a string, or the text parts of a list of content parts."""
        if isinstance(self.content, str):
            return self.content
        if self.content is None:
            raise OpenAIError(400, f"messages[{index}].content is missing", "messages")
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(400, f"messages[{index}].content: only text parts are supported, got "
                                       f"{part.get('type')!r}", "messages")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    prompt_field: ClassVar[str] = "messages"

    def prompt_input(self) -> tuple[None, list[dict]]:
        """(prompt, messages) for TokenizerPool.prompt_ids."""
        return None, [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]

    def max_tokens_given(self) -> tuple[int | None, str]:
        """The newer name wins when both are given (OpenAI deprecates max_tokens for chat)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


def parse(model: type[_Sampling], body) -> _Sampling:
    """A request model from a decoded JSON body; OpenAIError (400) names the first bad field."""
    if not isinstance(body, Mapping):
        raise OpenAIError(400, "the request body must be a JSON object")
    if not isinstance(body.get("model"), str):
        raise OpenAIError(400, "model is required: the id GET /v1/models lists", "model")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        top = str(first["loc"][0]) if first["loc"] else None
        field = _field(first["loc"])
        # A value no member of a union accepts fails once per member: say what would have been accepted.
        alternatives = list(dict.fromkeys(_union_member(err["loc"]) for err in e.errors()
                                          if _field(err["loc"]) == field and _union_member(err["loc"])))
        if len(alternatives) > 1:
            raise OpenAIError(400, f"invalid {field}: expected {' or '.join(alternatives)}", top) from None
        raise OpenAIError(400, f"invalid {field or 'body'}: {first['msg']}", top) from None


def _field(loc) -> str:
    """The dotted field of a pydantic error location, up to a union member's name."""
    parts = []
    for part in loc:
        if _type_tag(part):
            break
        parts.append(str(part))
    return ".".join(parts)


def _union_member(loc) -> str | None:
    return next((str(p) for p in loc if _type_tag(p)), None)


def _type_tag(part) -> bool:
    """pydantic names the member of a union that failed in the error's location (`str`, `list[int]`)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "none") or "[" in part)


async def build_request(parsed: CompletionRequest | ChatCompletionRequest, tokenizers: TokenizerPool,
                        limits: RequestLimits, req_id: str, max_tokens: int | None) -> Request:
    """The coordinator's Request, its prompt tokenized on the tokenizer thread within `max_tokens`
    (the context length; None while unknown); OpenAIError (400) names the bad field."""
    params = parsed.sampling_params(limits)
    prompt, messages = parsed.prompt_input()
    try:
        ids = await tokenizers.prompt_ids(prompt, messages, max_tokens)
    except ValueError as e:
        raise invalid(str(e), parsed.prompt_field) from None
    return new_request(req_id, ids, params)
