"""Bearer-token authentication for the public gRPC server."""
from __future__ import annotations

import hmac

import grpc
from grpc_health.v1 import health_pb2

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every call except health checks."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(f"/{HEALTH_SERVICE_NAME}/"):
            return handler
        metadata = dict(details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._expected):
            return handler
        message = "missing or wrong bearer token (send 'authorization: Bearer <token>' metadata)"

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - makes this an async generator

        ser, de = handler.response_serializer, handler.request_deserializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(deny, de, ser)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny_stream, de, ser)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(deny, de, ser)
        return grpc.stream_stream_rpc_method_handler(deny_stream, de, ser)
