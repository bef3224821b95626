"""The systemd notify protocol: datagrams of ``KEY=VALUE`` lines to the socket in ``$NOTIFY_SOCKET``.

A leading ``@`` names a socket in the abstract namespace. Without ``NOTIFY_SOCKET`` (not started by
systemd with Type=notify) every call is a no-op, so the daemon calls it unconditionally.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    """One adapter over ``$NOTIFY_SOCKET``; failures to send are logged, never raised."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        self._address: str | bytes | None = None
        if addr.startswith("@"):
            self._address = b"\0" + addr[1:].encode()
        elif addr.startswith("/"):
            self._address = addr
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        self.watchdog_usec = int(usec) if usec.isdigit() and (not pid or pid == str(os.getpid())) else 0
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self._address is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings (half the systemd timeout), or None when not watched."""
        return self.watchdog_usec / 2_000_000 if self.watchdog_usec else None

    def notify(self, **fields: str) -> bool:
        """Send ``KEY=VALUE`` lines (keyword names upper-cased); True when a datagram was sent."""
        if self._address is None:
            return False
        payload = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                # non-blocking: a receiver that stopped reading must never stall the agent
                self._sock = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
                )
            self._sock.sendto(payload, self._address)
        except OSError as e:
            log.debug("sd_notify to %r failed: %s", self._address, e)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify(ready="1", **({"status": status} if status else {}))

    def status(self, text: str) -> bool:
        return self.notify(status=text)

    def watchdog(self) -> bool:
        return self.notify(watchdog="1")

    def reloading(self) -> bool:
        return self.notify(reloading="1")

    def stopping(self) -> bool:
        return self.notify(stopping="1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
