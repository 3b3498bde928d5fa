"""Who is calling: a bearer token (stored hashed in the tokens file) or an mTLS client
certificate, mapped to a tenant that the servicer reads from `CURRENT_TENANT`.

Tokens file (`FXPORT_TOKENS_FILE`): one `TENANT: SHA256-HEX` line per token, `#` comments,
the same tenant on several lines for rotation. Only digests are stored, never tokens; the
file is re-read when it changes (a Kubernetes Secret update needs no restart) and a file
that no longer parses refuses every token until fixed (fail closed). Tokens are 256-bit
random strings (`fxport tokens new`), so a plain sha256 is enough: there is nothing to
brute-force that a slow password hash would protect.

Health and reflection stay open (the kubelet's gRPC probes send no credentials); every
other call without valid credentials ends UNAUTHENTICATED before the servicer runs.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import grpc

from fxport.config import Settings
from fxport.errors import FxportError, PermissionDenied, Unauthenticated
from fxport.service.handlers import wrap_handler
from fxport.service.status import abort, status_of
from fxport.service.tenancy import CURRENT_TENANT
from fxport.storage import SHA256_RE, TENANT_RE

log = logging.getLogger("fxport.auth")

TOKEN_PREFIX = "fxp_"
# Methods callable without credentials: Kubernetes probes and grpcurl-style discovery.
OPEN_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
MAX_TOKEN_CHARS = 512


class TokensFileError(ValueError):
    """The tokens file is missing or malformed; the message names the file and line."""


class InsecureListen(ValueError):
    """Refusing to serve a non-loopback address without authentication."""


def new_token() -> str:
    """A fresh API token: 256 random bits, URL-safe, prefixed so secret scanners spot it."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def token_entry(tenant: str, token: str) -> str:
    """The tokens-file line for `token` (raises ValueError for an invalid tenant name)."""
    if not TENANT_RE.match(tenant):
        raise ValueError(f"tenant {tenant!r}: use 1-63 of lowercase letters, digits, _ and -, starting with a "
                         "letter or digit")
    return f"{tenant}: {hash_token(token)}"


@dataclass(frozen=True)
class TokenEntry:
    tenant: str
    sha256: str


def parse_tokens(text: str, source: str = "tokens file") -> list[TokenEntry]:
    entries = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        tenant, sep, digest = line.partition(":")
        tenant, digest = tenant.strip(), digest.strip().lower()
        if not sep or not TENANT_RE.match(tenant):
            raise TokensFileError(f"{source} line {lineno}: expected 'TENANT: SHA256-HEX' with a tenant of "
                                  "lowercase letters, digits, _ and -")
        if not SHA256_RE.match(digest):
            raise TokensFileError(f"{source} line {lineno}: the digest must be 64 hex digits (the sha256 of the "
                                  "token, from `fxport tokens hash`), not the token itself")
        entries.append(TokenEntry(tenant, digest))
    return entries


class TokenTable:
    """The tokens file, re-read whenever its (inode, size, mtime) changes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._entries: list[TokenEntry] = []
        self._load(strict=True)

    def _load(self, strict: bool) -> None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            if stamp == self._stamp:
                return
            entries = parse_tokens(self.path.read_text(), source=str(self.path))
        except (OSError, UnicodeDecodeError, TokensFileError) as exc:
            if strict:
                raise TokensFileError(f"cannot use tokens file {self.path}: {exc}") from None
            if self._stamp is not None or self._entries:
                log.error("tokens file %s is unusable; refusing every token until it is fixed: %s", self.path, exc)
            self._stamp, self._entries = None, []
            return
        self._stamp, self._entries = stamp, entries
        log.info("tokens file loaded", extra={"path": str(self.path), "tokens": len(entries),
                                              "tenants": len({e.tenant for e in entries})})

    def tenant_for(self, token: str) -> str | None:
        """The tenant whose digest matches; every entry is compared in constant time."""
        with self._lock:
            self._load(strict=False)
            entries = self._entries
        digest = hash_token(token)
        found = None
        for entry in entries:
            if hmac.compare_digest(entry.sha256, digest) and found is None:
                found = entry.tenant
        return found


class AuthInterceptor(grpc.ServerInterceptor):
    """Authenticates every call except health/reflection and sets the tenant for its handler.

    With mTLS the verified client certificate's CN is the tenant (a bearer token, if also
    sent, must name the same tenant); otherwise the `authorization: Bearer …` token is.
    """

    def __init__(self, tokens: TokenTable | None, mtls: bool) -> None:
        self.tokens = tokens
        self.mtls = mtls

    def _refuse(self, context: grpc.ServicerContext, method: str, error: FxportError) -> NoReturn:
        log.warning("rpc refused", extra={"rpc": method, "code": status_of(error).name, "reason": str(error),
                                          "peer": context.peer()})
        abort(context, error)

    def _bearer(self, context: grpc.ServicerContext, method: str) -> str | None:
        values = [v for k, v in context.invocation_metadata() if k == "authorization"]
        if not values:
            return None
        if len(values) > 1:
            self._refuse(context, method, Unauthenticated("more than one authorization header"))
        scheme, _, token = str(values[0]).strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(token) > MAX_TOKEN_CHARS:
            self._refuse(context, method, Unauthenticated("the authorization header must be 'Bearer <token>'"))
        return token

    def _certificate_tenant(self, context: grpc.ServicerContext, method: str) -> str | None:
        if not self.mtls:
            return None
        names = context.auth_context().get("x509_common_name") or []
        if not names:
            return None
        cn = names[0].decode("utf-8", "replace") if isinstance(names[0], bytes) else str(names[0])
        if not TENANT_RE.match(cn):
            self._refuse(context, method, PermissionDenied(
                f"client certificate CN {cn[:80]!r} is not a tenant name (lowercase letters, digits, _ and -)"))
        return cn

    def authenticate(self, context: grpc.ServicerContext, method: str) -> str:
        """The caller's tenant, or the call is aborted UNAUTHENTICATED / PERMISSION_DENIED."""
        cert_tenant = self._certificate_tenant(context, method)
        token = self._bearer(context, method)
        token_tenant = None
        if token is not None:
            token_tenant = self.tokens.tenant_for(token) if self.tokens is not None else None
            if token_tenant is None and cert_tenant is None:
                self._refuse(context, method, Unauthenticated("invalid token"))
        if cert_tenant is not None:
            if token is not None and token_tenant != cert_tenant:
                self._refuse(context, method,
                             Unauthenticated("the token does not belong to the client certificate's tenant"))
            return cert_tenant
        if token_tenant is not None:
            return token_tenant
        how = "send 'authorization: Bearer <token>' (fxport --token / FXPORT_TOKEN)" if self.tokens is not None \
            else "present a client certificate"
        self._refuse(context, method, Unauthenticated(f"missing credentials: {how}"))

    def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        method = details.method
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler

        def unary_response(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(request: Any, context: grpc.ServicerContext) -> Any:
                reset = CURRENT_TENANT.set(self.authenticate(context, method))
                try:
                    return behavior(request, context)
                finally:
                    CURRENT_TENANT.reset(reset)
            return wrapper

        def stream_response(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(request: Any, context: grpc.ServicerContext) -> Any:
                reset = CURRENT_TENANT.set(self.authenticate(context, method))
                try:
                    yield from behavior(request, context)
                finally:
                    CURRENT_TENANT.reset(reset)
            return wrapper

        return wrap_handler(handler, unary_response, stream_response)


def is_loopback(listen: str) -> bool:
    """Whether `host:port` (or a unix: socket) is reachable from this host only."""
    if listen.startswith(("unix:", "unix-abstract:")):
        return True
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name or "": it may resolve (or bind) to any interface
        return False


def build_auth(settings: Settings) -> AuthInterceptor | None:
    """The interceptor the settings ask for, or None (no auth: loopback or --insecure-no-auth).

    Raises InsecureListen for a non-loopback address with no authentication and no explicit
    opt-out, and TokensFileError / ValueError for unusable credential settings."""
    if settings.tls_client_ca_file and not (settings.tls_cert_file and settings.tls_key_file):
        raise ValueError("FXPORT_TLS_CLIENT_CA_FILE (mTLS) needs FXPORT_TLS_CERT_FILE and FXPORT_TLS_KEY_FILE")
    tokens = TokenTable(settings.tokens_file) if settings.tokens_file else None
    mtls = bool(settings.tls_client_ca_file)
    if tokens is not None or mtls:
        return AuthInterceptor(tokens, mtls)
    if is_loopback(settings.listen):
        return None
    if settings.insecure_no_auth:
        log.warning("serving %s WITHOUT authentication (--insecure-no-auth): every caller is tenant 'default'",
                    settings.listen)
        return None
    raise InsecureListen(
        f"refusing to serve {settings.listen} without authentication: set FXPORT_TOKENS_FILE (entries from "
        "`fxport tokens new TENANT`) or FXPORT_TLS_CLIENT_CA_FILE for mTLS, listen on 127.0.0.1, or pass "
        "--insecure-no-auth (FXPORT_INSECURE_NO_AUTH=1) when a proxy in front authenticates"
    )


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS (and mTLS) credentials from the configured PEM files; None = plaintext."""
    if not (settings.tls_cert_file or settings.tls_key_file):
        return None
    if not (settings.tls_cert_file and settings.tls_key_file):
        raise ValueError("TLS needs both FXPORT_TLS_CERT_FILE and FXPORT_TLS_KEY_FILE")
    try:
        key = Path(settings.tls_key_file).read_bytes()
        chain = Path(settings.tls_cert_file).read_bytes()
        ca = Path(settings.tls_client_ca_file).read_bytes() if settings.tls_client_ca_file else None
    except OSError as exc:
        raise ValueError(f"cannot read TLS file {exc.filename}: {exc.strerror}") from None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca, require_client_auth=ca is not None)
