"""TCP ports for the test peers, picked below the kernel's ephemeral range.

A port the kernel handed out (bind to port 0) is free only until the next outgoing connection of any process on
the machine takes it as its local port; a peer that binds it seconds later can then fail with "address already
in use". The kernel never hands out a port below ``net.ipv4.ip_local_port_range``, so a port picked there and
found unbound stays free until another picker takes it; the pick is random over some ten thousand ports, so two
test workers rarely meet.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000
_TRIES = 200


def _ephemeral_low() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _unbound(ip: str, port: int) -> bool:
    # SO_REUSEADDR as the peers set it (Go, etcd): a port left in TIME_WAIT by an earlier peer counts as free
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


def free_port(ip: str = "127.0.0.1") -> int:
    """A TCP port no socket is bound to on ``ip`` nor on the wildcard address, outside the ephemeral range."""
    low = _ephemeral_low()
    if low - _LOWEST < 1000:  # a machine with a widened ephemeral range: take what the kernel gives
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return int(s.getsockname()[1])
    rng = random.SystemRandom()
    for _ in range(_TRIES):
        port = rng.randrange(_LOWEST, low)
        if _unbound("0.0.0.0", port) and (ip == "0.0.0.0" or _unbound(ip, port)):
            return port
    raise RuntimeError(f"no free TCP port in {_LOWEST}-{low - 1} after {_TRIES} tries")


__all__ = ["free_port"]
