"""Client for the specdec Generation service (imports only grpc and the generated protobufs)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import grpc

from specdec.v1 import generation_pb2, generation_pb2_grpc

_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class GenerateResult(NamedTuple):
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: generation_pb2.GenerationStats


def build_request(prompt: str | Sequence[int] | None = None, *, messages: Sequence[Mapping[str, str]] | None = None,
                  max_new_tokens: int | None = None, temperature: float | None = None, top_k: int | None = None,
                  top_p: float | None = None, repetition_penalty: float | None = None, seed: int | None = None,
                  stop: Sequence[str] = (), ignore_eos: bool = False, num_speculative_tokens: int | None = None
                  ) -> generation_pb2.GenerateRequest:
    """A GenerateRequest from a prompt (text or token ids) or from chat `messages` (a list of
    {"role": "system" | "user" | "assistant", "content": text}, which the server renders with the
    model's chat template); None leaves a field unset (the server's default applies)."""
    request = generation_pb2.GenerateRequest(stop=list(stop), ignore_eos=ignore_eos)
    if messages is not None:
        request.messages.extend(generation_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    if isinstance(prompt, str):
        request.prompt = prompt
    elif prompt is not None:
        request.prompt_token_ids.extend(int(t) for t in prompt)
    if max_new_tokens is not None:
        request.max_new_tokens = max_new_tokens
    if num_speculative_tokens is not None:
        request.num_speculative_tokens = num_speculative_tokens
    sampling = request.sampling
    for name, value in (("temperature", temperature), ("top_p", top_p),
                        ("repetition_penalty", repetition_penalty), ("seed", seed)):
        if value is not None:
            setattr(sampling, name, value)
    if top_k is not None:
        sampling.top_k = top_k
    return request


class GenerationClient:
    """`GenerationClient("host:50051")`; token adds `authorization: Bearer <token>`; tls_ca (a PEM
    file path, or True for the system roots) switches to TLS."""

    def __init__(self, address: str, token: str | None = None, tls_ca: str | bool | None = None):
        self.address = address
        options = [("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES)]
        if tls_ca:
            root = open(tls_ca, "rb").read() if isinstance(tls_ca, str) else None
            self._channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=root), options)
        else:
            self._channel = grpc.insecure_channel(address, options)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def generate_stream(self, prompt: str | Sequence[int] | None = None, *, timeout: float | None = None,
                        wait_for_ready: bool = False, **options):
        """Stream GenerateResponse messages. The returned call is an iterator and also has
        `.cancel()`; gRPC errors surface as grpc.RpcError while iterating. Options: see
        build_request (messages instead of a prompt for chat, max_new_tokens, temperature, top_k,
        top_p, repetition_penalty, seed, stop, ignore_eos, num_speculative_tokens)."""
        return self._stub.Generate(build_request(prompt, **options), timeout=timeout, metadata=self._metadata,
                                   wait_for_ready=wait_for_ready)

    def generate(self, prompt: str | Sequence[int] | None = None, **kwargs) -> GenerateResult:
        """The whole completion: (token_ids, text, finish_reason, stats). Chat: `messages=[...]`."""
        token_ids: list[int] = []
        texts: list[str] = []
        finish_reason, stats = "", generation_pb2.GenerationStats()
        for response in self.generate_stream(prompt, **kwargs):
            token_ids.extend(response.token_ids)
            texts.append(response.text)
            if response.finish_reason:
                finish_reason = response.finish_reason
                stats = response.stats
        return GenerateResult(token_ids, "".join(texts), finish_reason, stats)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
