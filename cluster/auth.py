"""Bearer-token authentication and TLS, for the servers (frontend) and the clients (CLI, bench).

The token comes from ``THINKSERVE_API_TOKEN`` where ``thinkserve up`` runs (or ``frontend.auth.token``
in the config); clients send it from the same variable as ``authorization: Bearer <token>``, in gRPC
metadata or the HTTP header. Admin always requires it once a token is set; Inference (and the HTTP
``/v1`` API) only with ``frontend.auth.inference: true``. Health checks and reflection stay open.
Tokens are compared in constant time and never logged.
"""
from __future__ import annotations

import hmac
import os
from pathlib import Path

import grpc

TOKEN_ENV = "THINKSERVE_API_TOKEN"
CA_ENV = "THINKSERVE_TLS_CA"          # clients: PEM file of the CA (or the self-signed cert) to trust
ADMIN_SERVICE = "/thinkserve.v1.Admin/"
INFERENCE_SERVICE = "/thinkserve.v1.Inference/"
UNAUTHENTICATED_MESSAGE = "missing or wrong bearer token (send 'authorization: Bearer <THINKSERVE_API_TOKEN>')"


def token_from_env() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


class TokenCheck:
    """``ok(authorization header)``: whether it is ``Bearer <token>``, compared in constant time."""

    def __init__(self, token: str):
        self._want = f"Bearer {token}".encode()

    def ok(self, header: str | bytes | None) -> bool:
        if header is None:
            return False
        got = header.encode() if isinstance(header, str) else header
        return hmac.compare_digest(got, self._want)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to the protected services without the token: UNAUTHENTICATED."""

    def __init__(self, token: str, protected: tuple[str, ...]):
        self.check = TokenCheck(token)
        self.protected = protected

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.protected):
            return handler
        md = details.invocation_metadata or ()
        if self.check.ok(next((v for k, v in md if k == "authorization"), None)):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that aborts with UNAUTHENTICATED."""
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        yield  # pragma: no cover - makes this an async generator, as a streaming handler must be

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(deny, **kw)


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    """gRPC server credentials from PEM files; errors name the config field."""
    return grpc.ssl_server_credentials([(_read("frontend.tls.key_file", key_file),
                                         _read("frontend.tls.cert_file", cert_file))])


def _read(field: str, path: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ValueError(f"{field}: cannot read {path}: {e.strerror}") from None


# ----------------------------------------------------------------- clients
def client_metadata() -> tuple[tuple[str, str], ...]:
    tok = token_from_env()
    return (("authorization", f"Bearer {tok}"),) if tok else ()


def open_channel(address: str, tls_ca: str | None = None, *, aio: bool = False):
    """A gRPC channel to ``address``: TLS when ``tls_ca`` (or ``THINKSERVE_TLS_CA``) names a PEM file."""
    ca = tls_ca or os.environ.get(CA_ENV)
    mod = grpc.aio if aio else grpc
    if ca:
        return mod.secure_channel(address, grpc.ssl_channel_credentials(_read("--tls-ca", ca)))
    return mod.insecure_channel(address)
