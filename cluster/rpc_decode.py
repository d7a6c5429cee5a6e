"""Register gRPC servicers so that bytes which are not a valid request message get
``INVALID_ARGUMENT``, not ``UNKNOWN``.

grpc-python deserializes a request before the handler runs; when the generated
``Message.FromString`` raises ``DecodeError`` the server answers ``UNKNOWN: Unexpected
DecodeError`` and no handler code can intervene. So each method's deserializer is wrapped to turn
a ``DecodeError`` into a ``Malformed`` value, and its handler to abort that value with
``INVALID_ARGUMENT``:

    bytes ──▶ FromString ──ok──▶ servicer method (unchanged)
                         └─DecodeError─▶ Malformed ──▶ abort(INVALID_ARGUMENT, "request: ...")

Only unary-request methods exist in thinkserve's services (``Generate`` streams responses only);
registering a client-streaming method here raises, rather than leaving it unprotected.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class Malformed:
    """What a request deserializer returns for bytes that do not parse."""

    message: str


def _tolerant(deserialize: Callable[[bytes], object], method: str) -> Callable[[bytes], object]:
    def parse(data: bytes):
        try:
            return deserialize(data)
        except DecodeError as e:
            return Malformed(f"request: not a valid {method} request message ({e})")
    return parse


def _guard_unary(handler):
    async def unary(request, context):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await handler(request, context)
    return unary


def _guard_stream(handler):
    async def stream(request, context):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        async for response in handler(request, context):
            yield response
    return stream


class _Collect:
    """Stands in for the server while a generated ``add_*Servicer_to_server`` registers."""

    def __init__(self):
        self.service = ""
        self.handlers: dict = {}

    def add_generic_rpc_handlers(self, _handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.service, self.handlers = service, handlers


def add_servicer(add_to_server: Callable, servicer, server) -> None:
    """``add_to_server`` is the generated ``add_XServicer_to_server``; registers ``servicer`` on
    ``server`` with malformed requests refused as ``INVALID_ARGUMENT``."""
    collected = _Collect()
    add_to_server(servicer, collected)
    handlers = {}
    for method, h in collected.handlers.items():
        if h.request_streaming:
            raise NotImplementedError(f"{collected.service}/{method}: client-streaming methods are not guarded")
        guarded = h._replace(request_deserializer=_tolerant(h.request_deserializer, method))
        if h.response_streaming:
            guarded = guarded._replace(unary_stream=_guard_stream(h.unary_stream))
        else:
            guarded = guarded._replace(unary_unary=_guard_unary(h.unary_unary))
        handlers[method] = guarded
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(collected.service, handlers),))
    server.add_registered_method_handlers(collected.service, handlers)
