"""An instant query of the Prometheus HTTP API (``GET /api/v1/query``), for the one collector
that reads what Prometheus already joined: the fabric collector's path localization reads the
fleet's pair verdicts (docs/fabric.md). Standard library only (urllib), with a timeout and a
bounded answer; every failure is a :class:`QueryError` of one line.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping

MAX_ANSWER_BYTES = 64 << 20  # 40,000 pairs answer in about 10 MiB


class QueryError(Exception):
    """The query could not be made or its answer read."""


def query(base_url: str, expr: str, timeout: float,
          limit: int = MAX_ANSWER_BYTES) -> list[tuple[Mapping[str, str], float]]:
    """The instant vector ``expr`` evaluates to now: (labels, value) per series."""
    if not base_url.startswith(("http://", "https://")):
        raise QueryError(f"{base_url!r} is not an http:// or https:// URL")
    url = (base_url.rstrip("/") + "/api/v1/query?"
           + urllib.parse.urlencode({"query": expr}))
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read(limit + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise QueryError(f"querying {base_url}: {getattr(exc, 'reason', exc)}") from None
    if len(body) > limit:
        raise QueryError(f"querying {base_url}: the answer is over {limit >> 20} MiB")
    try:
        data = json.loads(body)
        if data.get("status") != "success":
            raise QueryError(f"querying {base_url}: {data.get('error', 'status not success')}")
        result = data["data"]["result"]
        if data["data"]["resultType"] != "vector":
            raise QueryError(f"querying {base_url}: not an instant vector")
        return [({str(k): str(v) for k, v in r["metric"].items()}, float(r["value"][1]))
                for r in result]
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise QueryError(f"querying {base_url}: unreadable answer ({exc})") from None
