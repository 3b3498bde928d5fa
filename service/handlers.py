"""What every server interceptor here does to a handler: the same RPC, its behavior wrapped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


def wrap_handler(handler: Any, unary_response: Wrap, stream_response: Wrap) -> Any:
    """`handler` (a grpc.RpcMethodHandler, or None) with its behavior wrapped: by `unary_response`
    for the calls that answer once, by `stream_response` for the ones that stream their answer."""
    if handler is None:
        return None
    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary_response(handler.unary_unary), **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary_response(handler.stream_unary), **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream_response(handler.unary_stream), **kw)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(stream_response(handler.stream_stream), **kw)
    return handler
