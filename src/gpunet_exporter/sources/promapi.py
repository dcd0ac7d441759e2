"""An instant query of the Prometheus HTTP API (``GET /api/v1/query``), for the one collector
that reads what Prometheus already joined: the fabric collector's path localization reads the
fleet's pair verdicts (docs/fabric.md). Standard library only (urllib), with a timeout and a
bounded answer; every failure is a :class:`QueryError` of one line.

A :class:`Client` carries how to reach Prometheus, with the names and meaning of Prometheus's
own ``http_config``: a CA file for its certificate, a client certificate and key, HTTP basic
authentication with a password file, or a bearer token file. The credential files are read at
every query, so that a rotated token (a Kubernetes service account's) is picked up. Redirects
are not followed: they would carry the credentials to wherever the answer points.
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

MAX_ANSWER_BYTES = 64 << 20  # 40,000 pairs answer in about 10 MiB
MAX_SECRET_BYTES = 64 << 10  # a password or token file; a service account token is about 1 KiB


class QueryError(Exception):
    """The query could not be made or its answer read."""


class BadAccess(ValueError):
    """A setting of a :class:`Client` cannot serve; ``field`` names it (``url``, ``ca_file``
    ...), the message says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kw: Any) -> None:
        return None  # the 3xx answer becomes an HTTPError


def read_secret(path: str) -> str:
    """A password or token file's text, surrounding white space removed (as Prometheus reads
    its ``password_file`` and ``credentials_file``). Raises OSError or ValueError."""
    with open(path, "rb") as fh:
        raw = fh.read(MAX_SECRET_BYTES + 1)
    if len(raw) > MAX_SECRET_BYTES:
        raise ValueError(f"over {MAX_SECRET_BYTES >> 10} KiB")
    text = raw.decode("utf-8").strip()
    if not text:
        raise ValueError("empty")
    if any(c in text for c in "\r\n\0"):
        raise ValueError("more than one line")
    return text


class Client:
    """How to reach one Prometheus. Raises :class:`BadAccess` for a setting that cannot serve:
    a URL that is not http(s), TLS files on http://, a CA or certificate that does not load,
    both basic authentication and a bearer token, a password file without a user, or a
    credential file that cannot be read now."""

    def __init__(self, url: str, *, ca_file: str = "", cert_file: str = "",
                 key_file: str = "", username: str = "", password_file: str = "",
                 bearer_token_file: str = "") -> None:
        if not url.startswith(("http://", "https://")):
            raise BadAccess("url", f"{url!r} is not an http:// or https:// URL")
        self.url = url
        for field, value in (("ca_file", ca_file), ("cert_file", cert_file),
                             ("key_file", key_file)):
            if value and not url.startswith("https://"):
                raise BadAccess(field, f"set, but the URL {url!r} is not https://")
        if key_file and not cert_file:
            raise BadAccess("key_file", "set without cert_file")
        if username and bearer_token_file:
            raise BadAccess("bearer_token_file", "set with username: one of basic "
                                                 "authentication or a bearer token")
        if password_file and not username:
            raise BadAccess("password_file", "set without username")
        if username and not password_file:
            raise BadAccess("username", "set without password_file")
        self._context: ssl.SSLContext | None = None
        if url.startswith("https://"):
            try:
                self._context = ssl.create_default_context(cafile=ca_file or None)
            except (OSError, ssl.SSLError, ValueError) as exc:
                raise BadAccess("ca_file", f"{ca_file!r}: {_why(exc)}") from None
            if cert_file:
                try:
                    self._context.load_cert_chain(cert_file, key_file or None)
                except ssl.SSLError as exc:  # before OSError: it is one
                    raise BadAccess("cert_file", f"{cert_file!r} (key {key_file or 'in it'}): "
                                                 "not a PEM certificate with its private key "
                                                 f"({exc.reason or exc})") from None
                except (OSError, ValueError) as exc:
                    raise BadAccess("cert_file", f"{cert_file!r} (key {key_file or 'in it'}): "
                                                 f"{_why(exc)}") from None
        self._username, self._password_file = username, password_file
        self._token_file = bearer_token_file
        self._opener = urllib.request.build_opener(
            _NoRedirect, urllib.request.HTTPSHandler(context=self._context))
        for field, path in (("password_file", password_file),
                            ("bearer_token_file", bearer_token_file)):
            if path:
                try:
                    read_secret(path)
                except (OSError, ValueError) as exc:
                    raise BadAccess(field, f"{path!r}: {_why(exc)}") from None

    def _headers(self) -> dict[str, str]:
        try:
            if self._token_file:
                return {"Authorization": "Bearer " + read_secret(self._token_file)}
            if self._username:
                pair = f"{self._username}:{read_secret(self._password_file)}".encode()
                return {"Authorization": "Basic " + base64.b64encode(pair).decode()}
        except (OSError, ValueError) as exc:
            path = self._token_file or self._password_file
            raise QueryError(f"querying {self.url}: reading {path}: {_why(exc)}") from None
        return {}

    def query(self, expr: str, timeout: float,
              limit: int = MAX_ANSWER_BYTES) -> list[tuple[Mapping[str, str], float]]:
        """The instant vector ``expr`` evaluates to now: (labels, value) per series."""
        url = self.url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        request = urllib.request.Request(url, headers=self._headers())
        try:
            with self._opener.open(request, timeout=timeout) as resp:
                body = resp.read(limit + 1)
        except urllib.error.HTTPError as exc:
            raise QueryError(f"querying {self.url}: HTTP {exc.code} {exc.reason}"
                             f"{_error_of(exc)}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            # urllib wraps a failed handshake in a URLError; an alert after it (TLS 1.3 sends
            # the server's verdict on our certificate then) comes as the SSLError itself.
            reason = exc if isinstance(exc, ssl.SSLError) else getattr(exc, "reason", exc)
            if isinstance(reason, ssl.SSLError):
                reason = _tls_why(reason)
            elif isinstance(reason, ConnectionResetError) and self._context is not None:
                reason = (f"the connection was reset ({reason.strerror or reason}); if "
                          "Prometheus asks for a client certificate, see prometheus_cert_file")
            raise QueryError(f"querying {self.url}: {reason}") from None
        if len(body) > limit:
            raise QueryError(f"querying {self.url}: the answer is over {limit >> 20} MiB")
        try:
            data = json.loads(body)
            if data.get("status") != "success":
                raise QueryError(f"querying {self.url}: "
                                 f"{data.get('error', 'status not success')}")
            result = data["data"]["result"]
            if data["data"]["resultType"] != "vector":
                raise QueryError(f"querying {self.url}: not an instant vector")
            return [({str(k): str(v) for k, v in r["metric"].items()}, float(r["value"][1]))
                    for r in result]
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise QueryError(f"querying {self.url}: unreadable answer ({exc})") from None


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _tls_why(exc: ssl.SSLError) -> str:
    """What a failed TLS handshake means here, in words."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (f"Prometheus's certificate did not verify ({exc.verify_message}): "
                "see prometheus_ca_file")
    reason = str(exc.reason or exc)
    if "BAD_CERTIFICATE" in reason or "CERTIFICATE_REQUIRED" in reason:
        return (f"Prometheus refused our client certificate, or its absence ({reason}): see "
                "prometheus_cert_file")
    if isinstance(exc, ssl.SSLEOFError):  # its alert lost to the close that follows it
        return (f"Prometheus closed the connection in TLS ({reason}); if it asks for a client "
                "certificate, see prometheus_cert_file")
    return reason


def _error_of(exc: urllib.error.HTTPError) -> str:
    """': <Prometheus's error text>' from an error answer's JSON body, else ''."""
    try:
        data = json.loads(exc.read(64 << 10))
        error = data.get("error") if isinstance(data, dict) else None
    except (OSError, ValueError):
        return ""
    return f": {str(error)[:200]}" if error else ""
