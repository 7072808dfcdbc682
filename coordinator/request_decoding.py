"""Decoding the public Generate request's bytes without letting a bad message become UNKNOWN.

gRPC answers a request deserializer that raises with status UNKNOWN and no useful message. The
servicer is registered here with a deserializer that never raises: bytes that are not a
GenerateRequest (corrupt protobuf, invalid UTF-8 in a string field) decode to a MalformedRequest,
which the servicer answers with INVALID_ARGUMENT and the reason. Requests larger than
ServerConfig.max_request_bytes never get here: the gRPC server's receive limit refuses them with
RESOURCE_EXHAUSTED before reading them whole; a large one that passes is reported to the
server's HeapTrimmer, so that its buffers go back to the operating system.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from specdec.v1 import generation_pb2

SERVICE = "specdec.v1.Generation"


@dataclass(frozen=True)
class MalformedRequest:
    """Stands for request bytes that did not decode; `reason` says why, for the client."""

    reason: str


def decode_generate_request(data: bytes) -> generation_pb2.GenerateRequest | MalformedRequest:
    try:
        return generation_pb2.GenerateRequest.FromString(data)
    except (DecodeError, UnicodeDecodeError) as e:
        detail = str(e).rpartition(": ")[2] or type(e).__name__
        if "UTF-8" in detail or isinstance(e, UnicodeDecodeError):
            return MalformedRequest(f"the request has a string field (prompt, stop, messages) that is not valid "
                                    f"UTF-8: {detail}; send text as UTF-8, or the prompt as prompt_token_ids")
        return MalformedRequest(f"the request is not a specdec.v1.GenerateRequest protobuf message: {detail}")


def add_generation_servicer(servicer, server: grpc.aio.Server, on_size: Callable[[int], None] | None = None) -> None:
    """generation_pb2_grpc.add_GenerationServicer_to_server, with decode_generate_request;
    `on_size(bytes)` is told every request's size (on the event loop)."""

    def decode(data: bytes):
        if on_size is not None:
            on_size(len(data))
        return decode_generate_request(data)

    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(
        servicer.Generate, request_deserializer=decode,
        response_serializer=generation_pb2.GenerateResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
