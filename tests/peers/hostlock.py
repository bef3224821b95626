"""One host-wide lock for the tests that own paths or devices of this host while they run (the whole-node
cluster's /var/lib/kubelet and /dev/nvidia*, the booted systemd roots): with several pytest workers, such a
test waits until no other one holds the host."""

from __future__ import annotations

import fcntl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK = Path("/run/lock/nodeagent-tests-host.lock") if Path("/run/lock").is_dir() else Path("/tmp/nodeagent-tests-host.lock")


@contextmanager
def host_owned(what: str, timeout: float = 1800.0) -> Iterator[None]:
    """Hold the host for ``what``; waits for another holder at most ``timeout`` seconds."""
    with LOCK.open("a") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what}: the host stayed held by another test for {timeout:.0f}s") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
