"""Decoding the public Generate request's bytes without letting a bad message become UNKNOWN.

gRPC answers a request deserializer that raises with status UNKNOWN and no useful message. The
servicer is registered here with a deserializer that never raises: bytes that are not a
GenerateRequest (corrupt protobuf, invalid UTF-8 in a string field) decode to a MalformedRequest,
which the servicer answers with INVALID_ARGUMENT and the reason. Requests larger than
ServerConfig.max_request_bytes never get here: the gRPC server's receive limit refuses them with
RESOURCE_EXHAUSTED before reading them whole.

Generate is registered as a stream of requests, though it takes one: gRPC reads a unary request
before the handler runs, so nothing could bound the requests read at once. As a stream, the
servicer reads the message itself, once the request has its waiting slot and room among the
request bytes in flight (coordinator.frontend.request_gate); each decoded message comes with its size.
"""
from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from specdec.v1 import generation_pb2

SERVICE = "specdec.v1.Generation"


@dataclass(frozen=True)
class MalformedRequest:
    """Stands for request bytes that did not decode; `reason` says why, for the client."""

    reason: str


@dataclass(frozen=True)
class ReceivedRequest:
    """A request message as the servicer reads it: decoded, and its size on the wire in bytes."""

    message: generation_pb2.GenerateRequest | MalformedRequest
    size: int


def decode_generate_request(data: bytes) -> generation_pb2.GenerateRequest | MalformedRequest:
    try:
        return generation_pb2.GenerateRequest.FromString(data)
    except (DecodeError, UnicodeDecodeError) as e:
        detail = str(e).rpartition(": ")[2] or type(e).__name__
        if "UTF-8" in detail or isinstance(e, UnicodeDecodeError):
            return MalformedRequest(f"the request has a string field (prompt, stop, messages) that is not valid "
                                    f"UTF-8: {detail}; send text as UTF-8, or the prompt as prompt_token_ids")
        return MalformedRequest(f"the request is not a specdec.v1.GenerateRequest protobuf message: {detail}")


def receive_generate_request(data: bytes) -> ReceivedRequest:
    return ReceivedRequest(decode_generate_request(data), len(data))


def add_generation_servicer(servicer, server: grpc.aio.Server) -> None:
    """Register `servicer.Generate(requests, context)`: a response stream for a request stream of
    ReceivedRequest (the client sends one GenerateRequest, as for any unary request)."""
    handlers = {"Generate": grpc.stream_stream_rpc_method_handler(
        servicer.Generate, request_deserializer=receive_generate_request,
        response_serializer=generation_pb2.GenerateResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
