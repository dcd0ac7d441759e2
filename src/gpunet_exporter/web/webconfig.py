"""``--web.config.file``: TLS and basic authentication in the Prometheus exporter-toolkit format.

The file is read and checked once, at start: an unknown or unsupported key, a missing or
unreadable file, a certificate that does not match its key, a malformed bcrypt hash or a bad
enumeration value is one ``ConfigError`` naming the file and the key. What it yields is an
``ssl.SSLContext`` (or None) for the HTTP server and a WSGI wrapper for basic authentication and
the extra response headers. docs/security.md is the user-facing description.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import logging
import os
import re
import ssl
import threading
import time
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpunet_exporter.config import Settings, make_settings, parse_settings, setting, settings_items
from gpunet_exporter.errors import ConfigError, key_text, short, text_problem
from gpunet_exporter.files import open_regular, read_yaml
from gpunet_exporter.web.httpserver import StartResponse, WSGIApp

log = logging.getLogger("gpunet.exporter")

CLIENT_AUTH = ("NoClientCert", "RequestClientCert", "RequireAnyClientCert",
               "VerifyClientCertIfGiven", "RequireAndVerifyClientCert")
VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
            "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
HEADERS: dict[str, tuple[str, ...]] = {  # header -> allowed values (lower case), () for any
    "Content-Security-Policy": (),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-Content-Type-Options": ("nosniff",),
    "X-XSS-Protection": (),
    "Strict-Transport-Security": (),
}

# exporter-toolkit keys we refuse, each with the reason printed after "not supported".
UNSUPPORTED: dict[str, str] = {
    "tls_server_config.cert": "inline PEM; put the certificate in a file and use cert_file",
    "tls_server_config.key": "inline PEM; put the key in a file and use key_file",
    "tls_server_config.client_ca": "inline PEM; put the CA in a file and use client_ca_file",
    "tls_server_config.cipher_suites": "Go cipher-suite names have no exact OpenSSL "
                                       "equivalent; the OpenSSL defaults of Python's ssl "
                                       "module are used",
    "tls_server_config.curve_preferences": "Python's ssl module cannot set a list of curves",
    "tls_server_config.client_allowed_sans": "client certificates are checked against "
                                             "client_ca_file only",
    "rate_limit": "put a reverse proxy in front of the exporter to limit the request rate",
}

_BCRYPT = re.compile(r"^\$2[aby]\$([0-9]{2})\$[./A-Za-z0-9]{53}$")
# What a WSGI server cannot send in a header value: control characters other than tab (a line
# break would end the header) and anything beyond Latin-1.
_HEADER_VALUE_BAD = re.compile(r"[\x00-\x08\x0a-\x1f\x7f\u0100-\U0010ffff]")
CACHE_SECONDS = 300.0  # how long a successful basic-auth check is remembered
CACHE_SIZE = 256  # and for how many (user, password) pairs at most
MAX_PEM_BYTES = 16 << 20  # a certificate, key or CA bundle (Mozilla's whole bundle: ~220 KiB)
PATH_SHOWN = 4096  # characters of a file name an error message shows (Linux's PATH_MAX)


@dataclass(frozen=True)
class TlsServerConfig(Settings):
    cert_file: str = setting(required=True)
    key_file: str = setting(required=True)
    client_auth_type: str = setting(default="NoClientCert", choices=CLIENT_AUTH)
    client_ca_file: str | None = setting()
    min_version: str = setting(default="TLS12", choices=tuple(VERSIONS))
    max_version: str = setting(default="TLS13", choices=tuple(VERSIONS))
    prefer_server_cipher_suites: bool = setting(default=True)


# The response headers one may set, by their names (no Python names); values as HEADERS allows.
if typing.TYPE_CHECKING:
    Headers = Settings
else:
    Headers = make_settings("Headers", {h: (str | None, setting()) for h in HEADERS})


@dataclass(frozen=True)
class HttpServerConfig(Settings):
    http2: bool | None = setting()
    headers: Headers = setting(default=Headers())


@dataclass(frozen=True)
class WebConfigFile(Settings):
    """The file's keys, those of exporter-toolkit that gpunet-exporter supports."""

    tls_server_config: TlsServerConfig | None = setting()
    http_server_config: HttpServerConfig = setting(default=HttpServerConfig())
    basic_auth_users: Mapping[str, str] = setting(default={})  # user -> bcrypt hash


@dataclass(frozen=True)
class WebConfig:
    ssl_context: ssl.SSLContext | None = None
    users: Mapping[str, str] = field(default_factory=dict)  # user -> bcrypt hash
    headers: Mapping[str, str] = field(default_factory=dict)
    client_auth_type: str = "NoClientCert"

    def describe(self) -> str:
        """For the start-up log line: "https, client certificates required, basic auth"."""
        parts = ["https" if self.ssl_context else "http"]
        if self.client_auth_type == "RequireAndVerifyClientCert":
            parts.append("client certificates required")
        elif self.client_auth_type == "VerifyClientCertIfGiven":
            parts.append("client certificates verified if given")
        if self.users:
            n = len(self.users)
            parts.append(f"basic auth for {n} user{'' if n == 1 else 's'}")
        return ", ".join(parts)


def _check_unsupported(raw: Any) -> None:
    if not isinstance(raw, dict):
        return
    for key, why in UNSUPPORTED.items():
        section, _, name = key.rpartition(".")
        where = raw.get(section) if section else raw
        if isinstance(where, dict) and name in where:
            raise ConfigError(f"key {key!r}: not supported by gpunet-exporter ({why})")
    http = raw.get("http_server_config")
    if isinstance(http, dict) and http.get("http2") is True:
        raise ConfigError("key 'http_server_config.http2': not supported by gpunet-exporter "
                          "(it serves HTTP/1.1 only; remove the key or set it to false)")


def _readable(path: str, key: str) -> None:
    """A regular file we may open, of at most MAX_PEM_BYTES: ssl reads it with a blocking open(),
    which a FIFO would hold up for ever, and reads all of it."""
    try:
        os.close(open_regular(path, MAX_PEM_BYTES))
    except ConfigError as exc:
        problem = str(exc).removeprefix("cannot read: ")
        raise ConfigError(f"key {key!r}: cannot read {short(path, PATH_SHOWN)}: "
                          f"{problem}") from None


class _Encrypted(Exception):
    pass


def _no_password() -> str:
    raise _Encrypted


def _ssl_context(tls: TlsServerConfig, base: str) -> tuple[ssl.SSLContext, str]:
    def path(key: str, name: str) -> str:
        value = os.path.join(base, name)  # relative to the web config file, as upstream
        _readable(value, f"tls_server_config.{key}")
        return value

    cert, key = path("cert_file", tls.cert_file), path("key_file", tls.key_file)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:  # the certificate alone first, so that a bad one is blamed on cert_file
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert)
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"key 'tls_server_config.cert_file': {cert!r} holds no valid PEM "
                          f"certificate ({exc})") from None
    try:
        ctx.load_cert_chain(cert, key, password=_no_password)
    except _Encrypted:
        raise ConfigError(f"key 'tls_server_config.key_file': {key!r} is encrypted; "
                          "encrypted private keys are not supported") from None
    except ssl.SSLError as exc:
        why = ("does not match the certificate in cert_file" if "KEY_VALUES_MISMATCH" in str(exc)
               else f"holds no valid PEM private key ({exc})")
        raise ConfigError(f"key 'tls_server_config.key_file': {key!r} {why}") from None

    auth = tls.client_auth_type
    if auth == "RequireAnyClientCert":
        raise ConfigError("key 'tls_server_config.client_auth_type': RequireAnyClientCert is not "
                          "supported (Python's ssl module cannot require a client certificate "
                          "without verifying it); use RequireAndVerifyClientCert with "
                          "client_ca_file")
    if tls.client_ca_file is not None:
        if auth in ("NoClientCert", "RequestClientCert"):
            raise ConfigError(f"key 'tls_server_config.client_ca_file': set, but "
                              f"client_auth_type {auth} does not verify client certificates; "
                              "use RequireAndVerifyClientCert")
        ca = path("client_ca_file", tls.client_ca_file)
        try:
            ctx.load_verify_locations(cafile=ca)
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError(f"key 'tls_server_config.client_ca_file': {ca!r} holds no valid "
                              f"PEM certificate ({exc})") from None
    elif auth in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert"):
        raise ConfigError(f"key 'tls_server_config.client_auth_type': {auth} needs "
                          "client_ca_file, the CA that signs the client certificates")
    # RequestClientCert asks for a certificate and trusts it blindly: nothing here reads an
    # unverified certificate, so for access it is the same as NoClientCert.
    ctx.verify_mode = {"VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
                       "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}.get(auth, ssl.CERT_NONE)

    low, high = tls.min_version, tls.max_version
    for k, v in (("min_version", low), ("max_version", high)):
        if v in ("TLS10", "TLS11"):
            raise ConfigError(f"key 'tls_server_config.{k}': {v} is not supported (TLS 1.0 and "
                              "1.1 are deprecated, RFC 8996); use TLS12 or TLS13")
    if VERSIONS[low] > VERSIONS[high]:
        raise ConfigError(f"key 'tls_server_config.min_version': {low} is above max_version "
                          f"{high}")
    ctx.minimum_version, ctx.maximum_version = VERSIONS[low], VERSIONS[high]
    if tls.prefer_server_cipher_suites:
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    return ctx, auth


def load_web_config(path: str) -> WebConfig:
    """Read and check a web configuration file. Raises ConfigError naming the file and key."""
    try:
        raw = read_yaml(path)
        if raw is None:
            raw = {}
        _check_unsupported(raw)
        users = raw.get("basic_auth_users") if isinstance(raw, dict) else None
        if users is None and isinstance(raw, dict):
            raw.pop("basic_auth_users", None)  # "basic_auth_users:" with nothing under it
        if isinstance(users, dict):
            for user in users:
                where = "basic_auth_users." + key_text(user)
                if not isinstance(user, str):
                    raise ConfigError(f"key {where!r}: a user name must be a string (quote it)")
                problem = text_problem(user)
                if problem is not None:  # BasicAuth compares UTF-8 bytes with the header's
                    raise ConfigError(f"key {where!r}: a user name cannot hold {problem}")
        cfg = parse_settings(WebConfigFile, raw, "")
        for user, hashed in cfg.basic_auth_users.items():
            m = _BCRYPT.match(hashed)
            if not m or not 4 <= int(m.group(1)) <= 31:
                where = "basic_auth_users." + key_text(user)
                raise ConfigError(f"key {where!r}: not a bcrypt hash (expected $2y$10$ followed "
                                  "by 53 characters)")
        headers = {name: value for name, value
                   in settings_items(cfg.http_server_config.headers).items() if value is not None}
        for name, value in headers.items():
            if _HEADER_VALUE_BAD.search(value):
                raise ConfigError(f"key {'http_server_config.headers.' + name!r}: a header "
                                  "value cannot hold control characters (line breaks) or "
                                  f"characters beyond U+00FF, got {value[:60]!r}")
            if HEADERS[name] and value.lower() not in HEADERS[name]:
                raise ConfigError(f"key {'http_server_config.headers.' + name!r}: expected one "
                                  f"of {', '.join(HEADERS[name])}, got {short(value)}")
        ctx, auth = None, "NoClientCert"
        if cfg.tls_server_config is not None:
            ctx, auth = _ssl_context(cfg.tls_server_config,
                                     os.path.dirname(os.path.abspath(path)))
    except ConfigError as exc:
        raise ConfigError(f"web config file {path!r}: {exc}") from None
    return WebConfig(ctx, dict(cfg.basic_auth_users), {k: v for k, v in headers.items() if v},
                     auth)


class BasicAuth:
    """Checks ``Authorization: Basic`` against bcrypt hashes.

    bcrypt is slow on purpose (about 70 ms at cost 10), so a successful check is remembered for
    ``CACHE_SECONDS``, for at most ``CACHE_SIZE`` pairs; the cache key is a SHA-256 of user, hash
    and password, so no password is kept and a changed hash never matches an old entry. An
    unknown user is checked against a dummy hash of the same cost, so that it takes as long as a
    wrong password; bcrypt's own comparison is constant-time.
    """

    def __init__(self, users: Mapping[str, str]) -> None:
        import bcrypt  # only basic auth needs it: an exporter without users starts without it

        self.bcrypt = bcrypt
        self.users = {u.encode(): h.encode() for u, h in users.items()}
        m = _BCRYPT.match(next(iter(users.values()), ""))
        cost = int(m.group(1)) if m else 10
        self.dummy = bcrypt.hashpw(b"not a password", bcrypt.gensalt(rounds=cost))
        self.cache: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self.lock = threading.Lock()

    def check(self, header: str) -> bool:
        scheme, _, value = header.strip().partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, sep, password = base64.b64decode(value.strip(), validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return False
        if not sep:
            return False
        hashed = self.users.get(user)
        key = hashlib.sha256(b"\0".join((user, hashed or b"", password))).digest()
        now = time.monotonic()
        with self.lock:
            expiry = self.cache.get(key)
            if expiry is not None and expiry > now:
                return True
        try:
            ok = self.bcrypt.checkpw(password, hashed or self.dummy) and hashed is not None
        except ValueError:  # bcrypt 5 refuses passwords over 72 bytes
            ok = False
        if ok:
            with self.lock:
                self.cache[key] = now + CACHE_SECONDS
                self.cache.move_to_end(key)
                while len(self.cache) > CACHE_SIZE:
                    self.cache.popitem(last=False)
        return ok


def wrap(app: WSGIApp, web: WebConfig) -> WSGIApp:
    """The app behind basic authentication (every path, as exporter-toolkit) and with the
    configured response headers."""
    auth = BasicAuth(web.users) if web.users else None
    extra = list(web.headers.items())
    if auth is None and not extra:
        return app

    def wrapped(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        def respond(status: str, headers: list[tuple[str, str]], *exc: Any) -> Any:
            return start_response(status, [*headers, *extra], *exc)

        if auth is not None and not auth.check(environ.get("HTTP_AUTHORIZATION", "")):
            body = b"Unauthorized\n"
            respond("401 Unauthorized", [("WWW-Authenticate", "Basic"),
                                         ("Content-Type", "text/plain; charset=utf-8"),
                                         ("Content-Length", str(len(body)))])
            return [body]
        return app(environ, respond)

    return wrapped
