"""--web.config.file: TLS, mutual TLS and basic auth, end to end with real TLS clients, and the
one-line start-up errors of a bad file."""

from __future__ import annotations

import base64
import http.client
import os
import socket
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from gpunet_exporter.web.webconfig import BasicAuth, WebConfig, wrap

from support.exporter import exporter_binary, free_port
from support.paths import UPSTREAM
from support.pki import HASH, PASSWORD, client_context, tls_section
from support.pki import make as make_pki

SYSFS = f"--path.sysfs={UPSTREAM / 'node_exporter-sysfs-infiniband' / 'tree' / 'sys'}"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA with a server and a client certificate, and a rogue CA with its own client."""
    return make_pki(tmp_path_factory.mktemp("pki"))


def web_config(tmp_path: Path, text: str) -> str:
    p = tmp_path / "web.yml"
    p.write_text(text)
    return str(p)


def test_tls_and_basic_auth(tmp_path: Path, pki: Path, run_exporter: Any) -> None:
    cfg = web_config(tmp_path, tls_section(pki) + f"basic_auth_users:\n  alice: '{HASH}'\n"
                     "http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n")
    ca = str(pki / "ca.crt")
    e = run_exporter(SYSFS, f"--web.config.file={cfg}", scheme="https", verify=ca,
                     auth=("alice", PASSWORD))
    assert "gpunet_scrape_collector_success" in e.metrics()
    for path in ("/metrics", "/", "/-/healthy", "/nope"):  # every path is protected
        for auth in (None, ("alice", "wrong"), ("bob", PASSWORD), ("alice", PASSWORD + "x")):
            r = requests.get(f"{e.url}{path}", verify=ca, auth=auth, timeout=10)
            assert r.status_code == 401, (path, auth)
            assert r.headers["WWW-Authenticate"] == "Basic"
            assert r.headers["X-Content-Type-Options"] == "nosniff"
        r = requests.get(f"{e.url}{path}", verify=ca, auth=("alice", PASSWORD), timeout=10)
        assert r.status_code == (404 if path == "/nope" else 200)
        assert r.headers["X-Content-Type-Options"] == "nosniff"
    # Keep-alive over TLS, as Prometheus scrapes: one connection for several requests.
    conn = http.client.HTTPSConnection("127.0.0.1", e.port, timeout=10,
                                       context=client_context(pki))
    token = base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
    conn.connect()
    sock = conn.sock
    for _ in range(3):
        conn.request("GET", "/metrics", headers={"Authorization": f"Basic {token}"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.version == 11 and resp.read()
        assert conn.sock is sock
    conn.close()
    assert "Traceback" not in e.stop()


def test_mutual_tls(tmp_path: Path, pki: Path, run_exporter: Any) -> None:
    cfg = web_config(tmp_path, tls_section(pki, "  client_auth_type: RequireAndVerifyClientCert\n"
                                                f"  client_ca_file: {pki / 'ca.crt'}\n"
                                                "  min_version: TLS13\n"))
    ca, good = str(pki / "ca.crt"), (str(pki / "client.crt"), str(pki / "client.key"))
    e = run_exporter(SYSFS, f"--web.config.file={cfg}", scheme="https", verify=ca, cert=good)
    assert "gpunet_scrape_collector_success" in e.metrics()
    rogue = (str(pki / "rogue.crt"), str(pki / "rogue.key"))
    for cert in (None, rogue):
        with pytest.raises(requests.exceptions.ConnectionError):  # SSLError is one
            requests.get(f"{e.url}/metrics", verify=ca, cert=cert, timeout=10)
    # The same with a bare ssl socket: the server's alert arrives at the first read (TLS 1.3).
    for cert_name in (None, "rogue"):
        ctx = client_context(pki, cert_name)
        with socket.create_connection(("127.0.0.1", e.port), timeout=10) as raw, \
                pytest.raises((ssl.SSLError, ConnectionError)), \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
            if not s.recv(1024):
                raise ConnectionError("closed without an answer")
    # A TLS 1.2 client is below min_version.
    ctx12 = client_context(pki, "client")
    ctx12.maximum_version = ssl.TLSVersion.TLSv1_2
    with socket.create_connection(("127.0.0.1", e.port), timeout=10) as raw, \
            pytest.raises(ssl.SSLError):
        ctx12.wrap_socket(raw, server_hostname="127.0.0.1")
    assert "gpunet_scrape_collector_success" in e.metrics()  # still serving
    assert "Traceback" not in e.stop()


def test_plain_http_and_silent_clients_do_not_hurt(tmp_path: Path, pki: Path,
                                                   run_exporter: Any) -> None:
    cfg = web_config(tmp_path, tls_section(pki))
    ca = str(pki / "ca.crt")
    e = run_exporter(SYSFS, f"--web.config.file={cfg}", scheme="https", verify=ca)
    plain = f"http://127.0.0.1:{e.port}/metrics"
    t0 = time.monotonic()
    # Plain HTTP fails the TLS handshake: the connection is closed at once, without an answer
    # (asyncio's TLS layer cannot answer in plain text); the client does not hang.
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(plain, timeout=10)
    assert time.monotonic() - t0 < 5
    # Silent clients (connected, never speaking) and garbage hold only their own threads.
    silent = [socket.create_connection(("127.0.0.1", e.port), timeout=10) for _ in range(5)]
    with socket.create_connection(("127.0.0.1", e.port), timeout=10) as junk:
        junk.sendall(b"\x00\x01\x02 not tls")
        assert junk.recv(100) == b""  # closed, no answer
    t0 = time.monotonic()
    for _ in range(3):
        assert requests.get(f"{e.url}/-/healthy", verify=ca, timeout=5).status_code == 200
        with pytest.raises(requests.exceptions.SSLError):  # a client that does not trust us
            requests.get(f"{e.url}/-/healthy", verify=str(pki / "rogue-ca.crt"), timeout=5)
    assert time.monotonic() - t0 < 5
    for s in silent:
        s.close()
    assert "gpunet_scrape_collector_success" in e.metrics()
    assert "Traceback" not in e.stop()


def run(*args: str) -> subprocess.CompletedProcess[str]:
    listen = f"--web.listen-address=127.0.0.1:{free_port()}"
    return subprocess.run([exporter_binary(), SYSFS, listen, *args], capture_output=True,
                          text=True, timeout=30, stdin=subprocess.DEVNULL)


def test_config_errors(tmp_path: Path, pki: Path) -> None:
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    cases: list[tuple[str, list[str]]] = [
        ("tls_server_config: [\n", ["invalid YAML at line 2"]),
        ("tls_server_config:\n  cert_fil: x\n",
         ["key 'tls_server_config.cert_fil': unknown key", "cert_file"]),
        ("basic_auth: {}\n", ["key 'basic_auth': unknown key"]),
        ("tls_server_config:\n  cert_file: nope.crt\n  key_file: nope.key\n",
         ["key 'tls_server_config.cert_file': cannot read", "nope.crt", "No such file"]),
        ("tls_server_config:\n  key_file: x\n",
         ["key 'tls_server_config.cert_file': missing, it is required"]),
        (f"tls_server_config:\n  cert_file: garbage.pem\n  key_file: {pki / 'server.key'}\n",
         ["key 'tls_server_config.cert_file'", "no valid PEM certificate"]),
        (f"tls_server_config:\n  cert_file: {pki / 'server.crt'}\n  key_file: garbage.pem\n",
         ["key 'tls_server_config.key_file'", "no valid PEM private key"]),
        (f"tls_server_config:\n  cert_file: {pki / 'server.crt'}\n"
         f"  key_file: {pki / 'client.key'}\n",
         ["key 'tls_server_config.key_file'", "does not match the certificate"]),
        ("basic_auth_users:\n  alice: secret\n",
         ["key 'basic_auth_users.alice': not a bcrypt hash"]),
        ("basic_auth_users:\n  alice: '$2y$10$short'\n",
         ["key 'basic_auth_users.alice': not a bcrypt hash"]),
        ("basic_auth_users:\n  123: x\n", ["key 'basic_auth_users.123'", "must be a string"]),
        (tls_section(pki, "  client_auth_type: RequireClientCert\n"),
         ["key 'tls_server_config.client_auth_type': expected one of NoClientCert"]),
        (tls_section(pki, "  client_auth_type: RequireAnyClientCert\n"),
         ["key 'tls_server_config.client_auth_type'", "RequireAnyClientCert is not supported"]),
        (tls_section(pki, "  client_auth_type: RequireAndVerifyClientCert\n"),
         ["key 'tls_server_config.client_auth_type'", "needs client_ca_file"]),
        (tls_section(pki, f"  client_ca_file: {pki / 'ca.crt'}\n"),
         ["key 'tls_server_config.client_ca_file'", "does not verify"]),
        (tls_section(pki, "  min_version: TLS11\n"),
         ["key 'tls_server_config.min_version'", "TLS11 is not supported"]),
        (tls_section(pki, "  min_version: TLS13\n  max_version: TLS12\n"),
         ["key 'tls_server_config.min_version'", "above max_version"]),
        (tls_section(pki, "  cipher_suites: [TLS_AES_128_GCM_SHA256]\n"),
         ["key 'tls_server_config.cipher_suites': not supported"]),
        (tls_section(pki, "  client_allowed_sans: [a]\n"),
         ["key 'tls_server_config.client_allowed_sans': not supported"]),
        ("rate_limit:\n  burst: 20\n", ["key 'rate_limit': not supported"]),
        ("http_server_config:\n  http2: true\n", ["key 'http_server_config.http2': not sup"]),
        ("http_server_config:\n  headers:\n    X-Frame-Options: always\n",
         ["key 'http_server_config.headers.X-Frame-Options': expected one of deny"]),
        ("- a list\n", ["top level: expected a mapping"]),
    ]
    for text, needles in cases:
        path = web_config(tmp_path, text)
        res = run(f"--web.config.file={path}")
        assert res.returncode == 2, (text, res.stderr)
        assert "Traceback" not in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
        for n in (f"web config file {path!r}", *needles):
            assert n in res.stderr, (text, res.stderr)
    res = run(f"--web.config.file={tmp_path / 'absent.yml'}")
    assert res.returncode == 2 and "absent.yml" in res.stderr and "cannot read" in res.stderr


def test_tls_files_must_be_regular_files(tmp_path: Path, pki: Path) -> None:
    """ssl opens cert_file, key_file and client_ca_file with a blocking open() and reads them
    whole: a FIFO there held up start-up for ever. Each is refused by its type (or its size)
    before ssl sees it; the timeout guards against a hang only."""
    os.mkfifo(tmp_path / "fifo.pem")
    (tmp_path / "dir.pem").mkdir()
    big = tmp_path / "big.pem"
    with big.open("wb") as fh:
        fh.truncate((16 << 20) + 1)  # sparse: over the 16 MiB limit without writing it
    ca = "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {}\n"
    cases = [
        ("tls_server_config:\n  cert_file: fifo.pem\n  key_file: x\n",
         f"key 'tls_server_config.cert_file': cannot read {str(tmp_path / 'fifo.pem')!r}: "
         "a FIFO, not a regular file"),
        (f"tls_server_config:\n  cert_file: {pki / 'server.crt'}\n  key_file: /dev/zero\n",
         "key 'tls_server_config.key_file': cannot read '/dev/zero': a character device, not a "
         "regular file"),
        (tls_section(pki, ca.format("dir.pem")),
         f"key 'tls_server_config.client_ca_file': cannot read {str(tmp_path / 'dir.pem')!r}: "
         "a directory, not a regular file"),
        (tls_section(pki, ca.format("big.pem")),
         f"key 'tls_server_config.client_ca_file': cannot read {str(big)!r}: too large: "
         f"{(16 << 20) + 1} bytes, the limit is 16 MiB"),
    ]
    for text, needle in cases:
        path = web_config(tmp_path, text)
        res = run(f"--web.config.file={path}")
        assert res.returncode == 2, (text, res.stderr)
        assert res.stderr == f"gpunet-exporter: web config file {path!r}: {needle}\n"


def test_relative_paths_and_empty_file(tmp_path: Path, pki: Path, run_exporter: Any) -> None:
    for name in ("server.crt", "server.key"):
        (tmp_path / name).write_bytes((pki / name).read_bytes())
    cfg = web_config(tmp_path, "tls_server_config:\n  cert_file: server.crt\n"
                               "  key_file: server.key\n")  # relative to the file, as upstream
    e = run_exporter(SYSFS, f"--web.config.file={cfg}", scheme="https", verify=str(pki / "ca.crt"))
    assert "gpunet_scrape_collector_success" in e.metrics()
    empty = tmp_path / "empty.yml"
    empty.write_text("# nothing configured\nbasic_auth_users:\n")
    e2 = run_exporter(SYSFS, f"--web.config.file={empty}")  # plain HTTP, no auth
    assert "gpunet_scrape_collector_success" in e2.metrics()


def test_basic_auth_unit() -> None:
    y_hash = HASH.replace("$2b$", "$2y$", 1)  # what htpasswd -B writes
    auth = BasicAuth({"alice": HASH, "carol": y_hash})

    def header(user: str, password: str | bytes) -> str:
        raw = password if isinstance(password, bytes) else password.encode()
        return "Basic " + base64.b64encode(user.encode() + b":" + raw).decode()

    assert auth.check(header("alice", PASSWORD)) and auth.check(header("carol", PASSWORD))
    assert auth.check("basic  " + header("alice", PASSWORD)[6:])  # scheme is case-insensitive
    assert len(auth.cache) == 2
    assert auth.check(header("alice", PASSWORD))  # from the cache
    for bad in ("", "Bearer x", "Basic !!!", "Basic " + base64.b64encode(b"nocolon").decode(),
                header("alice", "wrong"), header("alice", b"x" * 100), header("dave", PASSWORD),
                header("alice", PASSWORD.upper())):
        assert not auth.check(bad), bad
    assert len(auth.cache) == 2  # failures are not cached


def test_wrap_without_users_or_headers_is_identity() -> None:
    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [])
        return [b"ok"]

    assert wrap(app, WebConfig()) is app
    seen: list[Any] = []
    wrapped = wrap(app, WebConfig(headers={"X-Frame-Options": "deny"}))
    assert wrapped({}, lambda status, headers: seen.append((status, headers))) == [b"ok"]
    assert seen == [("200 OK", [("X-Frame-Options", "deny")])]


def test_handshake_timeout_closes_the_connection(pki: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from gpunet_exporter.web import httpserver as exporter_http

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    monkeypatch.setattr(exporter_http, "HANDSHAKE_TIMEOUT", 0.5)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(pki / "server.crt"), str(pki / "server.key"))
    httpd = exporter_http.serve(app, "127.0.0.1", free_port(), ctx, max_connections=8, threads=2)
    try:
        port = httpd.server_address[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as silent:
            t0 = time.monotonic()
            assert silent.recv(10) == b""  # closed by the server once the handshake times out
            assert 0.3 < time.monotonic() - t0 < 5
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                client_context(pki).wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(1024).startswith(b"HTTP/1.1 200")
    finally:
        httpd.shutdown()
        httpd.server_close()
        assert not httpd.thread.is_alive()
