"""Optional tokenizer loading: prompts may be token ids, so a model without a tokenizer still runs."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from jinja2.exceptions import TemplateError

from specdec.bounded_tokenize import PromptTooLong, check_width, encode_within
from specdec.model.source import resolve_model_source


def load_tokenizer(spec: str | Path):
    """The tokenizer of the model `spec` names (checkpoint directory, .gguf file or Hub id: see
    specdec.model.source), or None if it has none. Its `chat_template` is the model's chat
    template (None without one), ready for `tokenizer.apply_chat_template`."""
    return resolve_model_source(str(spec)).tokenizer()


def encode_prompt(tokenizer, prompt: str | Sequence[int], max_tokens: int | None = None,
                  token_width: int | None = None) -> list[int]:
    """Token ids of a prompt given as text or as ids; ValueError says what is wrong. With
    `max_tokens`, a text that clearly has more tokens is refused (PromptTooLong) at a cost bounded
    by max_tokens (specdec.bounded_tokenize; `token_width`: its max_token_bytes)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: send the prompt as token ids")
        if max_tokens is None:
            ids = list(tokenizer(prompt)["input_ids"])
        else:
            ids = encode_within(tokenizer, prompt, max_tokens, token_width)
        if not ids:
            raise ValueError("the prompt tokenizes to no tokens")
        return ids
    return [int(t) for t in prompt]


CHAT_ROLES = ("system", "user", "assistant")


def render_chat(tokenizer, messages: Sequence, max_tokens: int | None = None,
                token_width: int | None = None) -> list[int]:
    """Token ids of a conversation rendered with the model's own chat template, the assistant's
    turn opened (add_generation_prompt). The one place chat becomes a prompt: the gRPC and HTTP
    servers and LocalEngine all call it. ValueError says what is wrong. `max_tokens` and
    `token_width` as for encode_prompt: a conversation whose text alone cannot fit is refused
    before it is rendered, and the rendered text is tokenized within the bound."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; send a prompt instead")
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {role, content} messages")
    if not messages:
        raise ValueError("messages is empty: give at least one message")
    if max_tokens is not None and len(messages) > max_tokens:  # each renders to a token or more
        raise PromptTooLong(f"{len(messages)} messages cannot fit the context: at most {max_tokens} tokens fit")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a {{role, content}} object, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        conversation.append({"role": role, "content": content})
    if max_tokens is not None:
        check_width(sum(len(m["content"]) for m in conversation), max_tokens, token_width, "the messages")
    try:
        if max_tokens is None:
            ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
        else:  # render, then tokenize as apply_chat_template does (the template has the special tokens)
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            ids = encode_within(tokenizer, text, max_tokens, token_width, add_special_tokens=False,
                                what="the rendered conversation")
    except TemplateError as e:  # templates reject conversations they cannot render (raise_exception)
        raise ValueError(f"the model's chat template rejected the messages: {e}") from None
    if isinstance(ids, Mapping):  # some transformers versions return a BatchEncoding regardless
        ids = ids["input_ids"]
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("the chat template renders the messages to no tokens")
    return ids
