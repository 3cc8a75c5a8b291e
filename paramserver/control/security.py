"""Securing the control plane's port: the cluster token, the shard and admin credentials, TLS.

Owns reading token files, the server interceptor that refuses calls
without the right token (``UNAUTHENTICATED``; the standard health service
stays open so probes work), the client interceptor that attaches the token,
the shard credential (``ShardCredential``: the second secret a Join as a
shard must carry, so that a worker's or client's token admits no shard),
the admin credential (``AdminCredential``: the third secret that the calls
in ``ADMIN_METHODS``, those that change the cluster's state, must carry, so
that a worker's token neither stops the cluster nor forces a checkpoint),
and building TLS credentials from PEM files.  Which calls need which
credential is decided here and in the service; what a refusal is logged
as, by whoever hands in the ``RateLimitedLog``.
"""

import hmac
import pathlib
import secrets
from dataclasses import dataclass, field
from typing import Optional, Sequence

import grpc

from ..logs import RateLimitedLog
from .protocol import AUTH_METADATA_KEY, AUTH_SCHEME

#: Methods served without a token: liveness probes (Kubernetes, grpc_health_probe).
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)

#: Metadata key carrying the shard credential on a Join as a shard (only there).
SHARD_TOKEN_METADATA_KEY = "paramserver-shard-token"

#: Metadata key carrying the admin credential, on the calls in ``ADMIN_METHODS`` (only there).
ADMIN_TOKEN_METADATA_KEY = "paramserver-admin-token"

#: Coordinator calls that change the cluster's state for everyone: with an admin credential configured, only
#: its holders may make them (``ps-ctl checkpoint``, ``ps-ctl export`` through the cluster, ``ps-ctl shutdown``).
ADMIN_METHODS = frozenset({"Checkpoint", "Shutdown"})

#: What a refused call without the cluster token is told (the same whether the token was missing or wrong).
TOKEN_REFUSAL = "this cluster requires its token: pass --token-file (token= in Python)"


def read_token_file(path) -> str:
    """The token in ``path`` (surrounding whitespace dropped); it must not be empty."""
    token = pathlib.Path(path).read_text().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    if any(ch.isspace() for ch in token) or not token.isprintable():
        raise ValueError(f"token file {path} must hold one line of printable characters without spaces")
    return token


def metadata_value(metadata, key: str) -> Optional[bytes]:
    """The value of ``key`` in gRPC call metadata (pairs of str and str or bytes), as bytes; None when absent."""
    for name, value in metadata or ():
        if name == key:
            return value.encode() if isinstance(value, str) else value
    return None


def carries(metadata, key: str, secret: str) -> Optional[bool]:
    """Whether call ``metadata`` holds ``secret`` under ``key`` (compared in constant time); None when the key
    is absent."""
    given = metadata_value(metadata, key)
    if given is None:
        return None
    return hmac.compare_digest(given, secret.encode())


def same_secret(secret: str, other: Optional[str]) -> bool:
    """Whether ``other`` is this very ``secret``: two roles sharing one secret would not be scoped."""
    return other is not None and hmac.compare_digest(other.encode(), secret.encode())


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuse every call whose metadata lacks ``authorization: Bearer <token>``.

    Each refusal is recorded in ``refusals`` (kind ``UNAUTHENTICATED``), so a
    flood of them costs a line per interval, not a line each.
    """

    def __init__(self, token: str, open_method_prefixes: Sequence[str] = OPEN_METHOD_PREFIXES,
                 refusals: Optional[RateLimitedLog] = None):
        self._expected = (AUTH_SCHEME + token).encode()
        self._open = tuple(open_method_prefixes)
        self._refusals = refusals

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(self._open):
            return continuation(handler_call_details)
        given = metadata_value(handler_call_details.invocation_metadata, AUTH_METADATA_KEY)
        if given is not None and hmac.compare_digest(given, self._expected):
            return continuation(handler_call_details)
        why = "without a token" if given is None else "with a wrong token"
        name = method.rsplit("/", 1)[-1]  # "/paramserver.control.v1.Coordinator/Join" -> "Join"

        def refuse(_request, context):
            if self._refusals is not None:
                self._refusals.record("UNAUTHENTICATED",
                                      f"refused {name} from {context.peer()}: UNAUTHENTICATED: called {why}")
            context.abort(grpc.StatusCode.UNAUTHENTICATED, TOKEN_REFUSAL)

        handler = continuation(handler_call_details)
        if handler is not None and (handler.request_streaming or handler.response_streaming):
            return grpc.stream_stream_rpc_method_handler(lambda _requests, context: refuse(None, context))
        return grpc.unary_unary_rpc_method_handler(refuse)


@dataclass(frozen=True)
class ShardCredential:
    """The secret a Join as a shard must carry (metadata ``paramserver-shard-token``), besides the cluster
    token: the token admits workers and clients, only this admits shards.

    ``made_for_this_run``: the coordinator made it up at start (its cluster
    has a token but was given no ``--shard-token-file``) and hands it to its
    own shard processes only, so shards of other hosts cannot join; the
    refusal says so.  With ``--state-dir`` it is kept in the journal, so a
    server started again admits the shards it started before.
    """

    secret: str = field(repr=False)
    made_for_this_run: bool = False

    def __post_init__(self):
        if not self.secret:
            raise ValueError("the shard token is empty")

    @classmethod
    def for_this_run(cls) -> "ShardCredential":
        return cls(secrets.token_urlsafe(32), made_for_this_run=True)

    def same_as(self, token: Optional[str]) -> bool:
        """Whether ``token`` (the cluster token) is this very secret: then roles would not be scoped."""
        return same_secret(self.secret, token)

    def refusal(self, metadata) -> Optional[str]:
        """Why a Join as a shard with call ``metadata`` is refused; None when it carries this credential."""
        given = carries(metadata, SHARD_TOKEN_METADATA_KEY, self.secret)
        if given:
            return None
        if self.made_for_this_run:
            return ("this coordinator admits only the shards it started itself: its ps-server has --token-file "
                    "but no --shard-token-file; to add shards with ps-server --join, give both ps-servers the same "
                    "--shard-token-file")
        if given is None:
            return ("a Join as a shard needs the cluster's shard token, which this call lacks (the cluster token "
                    "admits workers and clients only): start ps-server --join with --shard-token-file, the file "
                    "the coordinator's ps-server was given")
        return ("the shard token of this Join is not the cluster's: --shard-token-file of ps-server --join must "
                "hold the same token as the coordinator's ps-server")


@dataclass(frozen=True)
class AdminCredential:
    """The secret that the calls in ``ADMIN_METHODS`` must carry (metadata ``paramserver-admin-token``),
    besides the cluster token where there is one: the cluster token admits workers, job authors' drivers and
    ``ps-ctl status``; only this one stops the cluster or asks for a checkpoint."""

    secret: str = field(repr=False)

    def __post_init__(self):
        if not self.secret:
            raise ValueError("the admin token is empty")

    def same_as(self, other: Optional[str]) -> bool:
        return same_secret(self.secret, other)

    def refusal(self, method: str, metadata) -> Optional[str]:
        """Why ``method`` with call ``metadata`` is refused; None when it needs no admin token or carries it."""
        if method not in ADMIN_METHODS:
            return None
        given = carries(metadata, ADMIN_TOKEN_METADATA_KEY, self.secret)
        if given:
            return None
        if given is None:
            return (f"{method} changes the cluster's state and needs the admin token, which this call lacks (the "
                    "cluster token does not give it): pass --admin-token-file (admin_token= in Python)")
        return (f"{method} carries an admin token that is not this cluster's: --admin-token-file must hold the "
                "token of the coordinator's ps-server --admin-token-file")


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
