"""Structured logging in logfmt or JSON, with the collector name in every collector record."""

from __future__ import annotations

import json
import logging
import sys
import time

LEVELS = ("debug", "info", "warn", "error")


def _fields(record: logging.LogRecord) -> dict[str, str]:
    ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    out = {
        "ts": f"{ts}.{int(record.msecs):03d}Z",
        "level": {"WARNING": "warn", "CRITICAL": "error"}.get(
            record.levelname, record.levelname.lower()),
    }
    collector = getattr(record, "collector", None)
    if collector:
        out["collector"] = str(collector)
    out["msg"] = _encodable(record.getMessage())
    if record.exc_info:
        out["err"] = _encodable(logging.Formatter().formatException(record.exc_info))
    return out


def _encodable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (a lone surrogate: a file or device name the
    kernel gave as bytes that are not UTF-8) as a backslash escape, so that no output
    encoding's errors setting can fail or drop the log line."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _logfmt_value(value: str) -> str:
    if value and not any(c in value for c in ' "=\\\n\t'):
        return value
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in _fields(record).items())


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), ensure_ascii=False)


def setup(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger("gpunet")
    root.handlers[:] = [handler]
    root.propagate = False
    root.setLevel({"warn": logging.WARNING}.get(level, getattr(logging, level.upper())))
