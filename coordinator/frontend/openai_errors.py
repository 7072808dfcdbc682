"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with an HTTP status."""
from __future__ import annotations

# The public name of each field the shared validation's messages may name, for the error's `param`.
PARAM_NAMES = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
               "repetition_penalty": "repetition_penalty", "seed": "seed", "stop": "stop"}


class OpenAIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.error_type = error_type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> OpenAIError:
    """A 400 from a validation message of the shared code, in OpenAI's words."""
    if param is None:
        named = [(message.find(name), public) for name, public in PARAM_NAMES.items() if name in message]
        param = min(named)[1] if named else None
    return OpenAIError(400, message.replace("max_new_tokens", "max_tokens"), param)
