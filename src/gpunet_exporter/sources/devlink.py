"""devlink health reporters (mlx5: fw, fw_fatal, vnic per device; tx, rx per port): each
one's state, error count and recovery count, read in-process through devlink generic netlink
(DEVLINK_CMD_HEALTH_REPORTER_GET, pyroute2), or parsed from ``devlink -j health show``.

Formats: docs/formats.md §13 (iproute2 devlink/devlink.c ``pr_out_health``).
"""

from __future__ import annotations

import errno
import json
from dataclasses import dataclass
from typing import Any, Protocol

from gpunet_exporter.sources.commands import (
    CommandError,
    CommandNotStarted,
    CommandTimeout,
    run_command,
)

# include/uapi/linux/devlink.h, enum devlink_health_reporter_state.
STATES = {0: "healthy", 1: "error"}


@dataclass(frozen=True)
class Reporter:
    """One health reporter: ``handle`` is devlink's ``bus/device`` (``pci/0000:41:00.0``),
    with ``/port`` for a port's reporter."""

    handle: str
    name: str
    state: str  # "healthy", "error", or what a newer kernel names otherwise
    errors: int
    recoveries: int

    @property
    def bus_device(self) -> str:
        """``pci/0000:41:00.0``: the handle without its port."""
        bus, _, rest = self.handle.partition("/")
        return f"{bus}/{rest.partition('/')[0]}"


class HealthReader(Protocol):
    """Where reporters come from: devlink netlink, ``devlink -j health show``, a stand-in.
    ``read`` raises OSError: ENOENT when the kernel has no devlink family (no devlink at
    all), another errno when the read failed."""

    def read(self) -> list[Reporter]: ...

    def close(self) -> None: ...


class NetlinkHealthReader:
    """DEVLINK_CMD_HEALTH_REPORTER_GET with NLM_F_DUMP: every reporter of every devlink
    instance and port, one socket kept between calls."""

    def __init__(self) -> None:
        self._sock: Any = None

    def read(self) -> list[Reporter]:
        from pyroute2.netlink import NLM_F_DUMP, NLM_F_REQUEST
        from pyroute2.netlink.devlink import (
            DEVLINK_CMD_HEALTH_REPORTER_GET,
            DevlinkSocket,
            devlinkcmd,
        )
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            if self._sock is None:
                sock = DevlinkSocket()
                try:
                    sock.bind()
                except BaseException:
                    sock.close()
                    raise
                self._sock = sock
            msg = devlinkcmd()
            msg["cmd"] = DEVLINK_CMD_HEALTH_REPORTER_GET
            msg["version"] = 1
            replies = list(self._sock.nlm_request(msg, msg_type=self._sock.prid,
                                                  msg_flags=NLM_F_REQUEST | NLM_F_DUMP))
        except NetlinkError as exc:
            self.close()
            raise OSError(exc.code, f"devlink: {exc}") from None
        except OSError:
            self.close()
            raise
        out = []
        for reply in replies:
            bus, dev = reply.get_attr("DEVLINK_ATTR_BUS_NAME"), reply.get_attr(
                "DEVLINK_ATTR_DEV_NAME")
            rep = reply.get_attr("DEVLINK_ATTR_HEALTH_REPORTER")
            if not bus or not dev or rep is None:
                continue
            port = reply.get_attr("DEVLINK_ATTR_PORT_INDEX")
            name = rep.get_attr("DEVLINK_ATTR_HEALTH_REPORTER_NAME")
            state = rep.get_attr("DEVLINK_ATTR_HEALTH_REPORTER_STATE")
            errs = rep.get_attr("DEVLINK_ATTR_HEALTH_REPORTER_ERR_COUNT")
            recs = rep.get_attr("DEVLINK_ATTR_HEALTH_REPORTER_RECOVER_COUNT")
            if name is None or state is None or errs is None or recs is None:
                continue  # devlink prints none of such a reporter either
            handle = f"{bus}/{dev}" + (f"/{port}" if port is not None else "")
            out.append(Reporter(handle, name, STATES.get(state, str(state)), errs, recs))
        return out

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def parse_health_json(text: str) -> list[Reporter]:
    """``devlink -j health show``: ``{"health": {HANDLE: [{"reporter": NAME, "state": STATE,
    "error": N, "recover": N, ...}, ...], ...}}``. Entries that lack a field are skipped; text
    that is not that document raises ValueError."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    health = doc.get("health") if isinstance(doc, dict) else None
    if not isinstance(health, dict):
        raise ValueError('no "health" object')
    out = []
    for handle, entries in health.items():
        if not isinstance(entries, list) or handle.count("/") not in (1, 2):
            continue
        for e in entries:
            if not isinstance(e, dict):
                continue
            name, state, errs, recs = (e.get(k) for k in ("reporter", "state", "error",
                                                          "recover"))
            if (isinstance(name, str) and isinstance(state, str) and type(errs) is int
                    and type(recs) is int and errs >= 0 and recs >= 0):
                out.append(Reporter(handle, name, state, errs, recs))
    return out


class CommandHealthReader:
    """Runs ``devlink -j health show`` (no shell, with a timeout) and parses it."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path, self.timeout = path, timeout

    def read(self) -> list[Reporter]:
        try:
            text = run_command([self.path, "-j", "health", "show"], self.timeout)
        except CommandTimeout as exc:
            raise OSError(errno.ETIMEDOUT, str(exc)) from None
        except CommandNotStarted as exc:  # no devlink program
            raise OSError(errno.ENOENT, str(exc)) from None
        except CommandError as exc:
            raise OSError(errno.EIO, str(exc)) from None
        try:
            return parse_health_json(text)
        except ValueError as exc:
            raise OSError(errno.EIO, f"{self.path} -j health show: {exc}") from None

    def close(self) -> None:
        pass
