"""TCP ports for the test peers, picked below the kernel's ephemeral range.

A port the kernel handed out (bind to port 0) is free only until the next outgoing connection of any process on
the machine takes it as its local port; a peer that binds it seconds later can then fail with "address already
in use". The kernel never hands out a port below ``net.ipv4.ip_local_port_range``, so a port picked there and
found unbound stays free until another picker takes it. Each pytest worker picks from its own slice of that
range, and a process never hands out one port twice, so two pickers of the suite never meet.
"""

from __future__ import annotations

import os
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


_WORKER_SLICES = 8
_handed_out: set[int] = set()


def _range(low: int) -> tuple[int, int]:
    """The ports this process picks from: a pytest worker (``gwN``) its own eighth of the range, so two workers
    never pick the same port; any other process all of it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not (worker.startswith("gw") and worker[2:].isdigit()):
        return _LOWEST, low
    size = (low - _LOWEST) // _WORKER_SLICES
    start = _LOWEST + (int(worker[2:]) % _WORKER_SLICES) * size
    return start, start + size


def free_port(ip: str = "127.0.0.1") -> int:
    """A TCP port no socket is bound to on ``ip`` nor on the wildcard address, outside the ephemeral range, and
    not handed out before by this process (a peer given two ports at once must get two different ones)."""
    low = _ephemeral_low()
    if low - _LOWEST < 1000:  # a machine with a widened ephemeral range: take what the kernel gives
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return int(s.getsockname()[1])
    first, end = _range(low)
    if len(_handed_out) > (end - first) // 2:  # a long run: ports handed out long ago are free again
        _handed_out.clear()
    rng = random.SystemRandom()
    for _ in range(_TRIES):
        port = rng.randrange(first, end)
        if port not in _handed_out and _unbound("0.0.0.0", port) and (ip == "0.0.0.0" or _unbound(ip, port)):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free TCP port in {first}-{end - 1} after {_TRIES} tries")


__all__ = ["free_port"]
