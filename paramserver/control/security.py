"""Securing the control plane's port: the cluster token and TLS.

Owns reading token files, the server interceptor that refuses calls
without the right token (``UNAUTHENTICATED``; the standard health service
stays open so probes work), the client interceptor that attaches the token,
and building TLS credentials from PEM files.
"""

import hmac
import pathlib
from dataclasses import dataclass
from typing import Optional, Sequence

import grpc

from .protocol import AUTH_METADATA_KEY, AUTH_SCHEME

#: Methods served without a token: liveness probes (Kubernetes, grpc_health_probe).
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


def read_token_file(path) -> str:
    """The token in ``path`` (surrounding whitespace dropped); it must not be empty."""
    token = pathlib.Path(path).read_text().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    if any(ch.isspace() for ch in token) or not token.isprintable():
        raise ValueError(f"token file {path} must hold one line of printable characters without spaces")
    return token


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuse every call whose metadata lacks ``authorization: Bearer <token>``."""

    def __init__(self, token: str, open_method_prefixes: Sequence[str] = OPEN_METHOD_PREFIXES):
        self._expected = (AUTH_SCHEME + token).encode()
        self._open = tuple(open_method_prefixes)

        def refuse(_request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "this cluster requires its token: pass --token-file (token= in Python)")

        self._refusal = grpc.unary_unary_rpc_method_handler(refuse)
        self._stream_refusal = grpc.stream_stream_rpc_method_handler(
            lambda _requests, context: refuse(None, context))

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(self._open):
            return continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(given, self._expected):
                    return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is not None and (handler.request_streaming or handler.response_streaming):
            return self._stream_refusal
        return self._refusal


class _ClientCallDetails(grpc.ClientCallDetails):
    def __init__(self, details, metadata):
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class TokenClientInterceptor(grpc.UnaryUnaryClientInterceptor):
    """Attach the cluster token to every call (works on plaintext and TLS channels alike)."""

    def __init__(self, token: str):
        self._entry = (AUTH_METADATA_KEY, AUTH_SCHEME + token)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        metadata = list(client_call_details.metadata or []) + [self._entry]
        return continuation(_ClientCallDetails(client_call_details, metadata), request)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for TLS: the server uses ``cert`` and ``key``; clients trust ``ca``."""

    cert: Optional[str] = None
    key: Optional[str] = None
    ca: Optional[str] = None

    def server_credentials(self) -> grpc.ServerCredentials:
        if not (self.cert and self.key):
            raise ValueError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
        key = _read(self.key, "--tls-key")
        cert = _read(self.cert, "--tls-cert")
        return grpc.ssl_server_credentials([(key, cert)])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Trust ``ca`` (a self-signed server certificate works as its own CA), else the system roots."""
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca, "--tls-ca") if self.ca else None)


def _read(path: str, flag: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read {flag} file {path}: {error.strerror}") from error
