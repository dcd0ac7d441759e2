"""A throw-away PKI made with the real openssl command: a CA with a server and a client
certificate, and a rogue CA with a client of its own, for the tests of TLS, mutual TLS and
basic authentication (the exporter's --web.config.file, and the fabric collector's queries to a
Prometheus behind them). The password is bcrypt-hashed as web.config.yml files hold it."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import bcrypt

PASSWORD = "s3cret pass"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "2", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
            "-out", f"{name}.crt", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext + "\n")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt",
            cwd=d)


def make(d: Path) -> Path:
    """In ``d``: ca, server (127.0.0.1 and localhost), client; rogue-ca and its rogue client
    (``<name>.crt`` and ``<name>.key`` each). Returns ``d``."""
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                             "extendedKeyUsage=serverAuth")
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth")
    _leaf(d, "rogue", "rogue-ca", "extendedKeyUsage=clientAuth")
    return d


def tls_section(pki: Path, extra: str = "") -> str:
    """A web.config.yml ``tls_server_config`` with the server's certificate, and ``extra``
    lines of it."""
    return (f"tls_server_config:\n  cert_file: {pki / 'server.crt'}\n"
            f"  key_file: {pki / 'server.key'}\n{extra}")


def client_context(pki: Path, cert: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if cert:
        ctx.load_cert_chain(str(pki / f"{cert}.crt"), str(pki / f"{cert}.key"))
    return ctx
