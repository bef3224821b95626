"""A Debian root booted by systemd as its PID 1, in a container made by systemd-nspawn.

The root directory (``NODEAGENT_DEBIAN_ROOT``, built and cached by tests/testbin/setup.sh) is never written:
each ``BootedRoot`` boots an overlay of it whose upper layer lives in a temporary directory, so the same
machine can be shut down and booted again with what it wrote (a second boot) and is gone afterwards.

This host has no systemd as its init, hence the nspawn options: ``--register=no --keep-unit`` (no machined,
no transient scope on a host bus), ``SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1`` (the container's systemd gets a
cgroup v2 tree below the launcher's group in the host's unified hierarchy). The launcher first moves itself
into a cgroup of its own, so the container's ``payload/`` and ``supervisor/`` groups land there and not at
the top of the host's hierarchy, and so everything the container started can be killed and removed at the
end. Commands run in the container through ``nsenter`` into its PID 1 (machinectl needs machined).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

CGROUP_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup/systemd"))
T = TypeVar("T")
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class BootError(RuntimeError):
    """The container did not boot, or did not stop; the message carries nspawn's last output lines."""


@dataclass(frozen=True)
class JournalEntry:
    """One journal record: ``unit`` is the unit the line is about (systemd's own lines) or from."""

    seq: int
    monotonic_us: int
    unit: str
    identifier: str
    message: str
    fields: dict[str, Any]


def _cgroup_dirs(name: str) -> list[Path]:
    return [root / name for root in CGROUP_ROOTS if (root / "cgroup.procs").exists()]


def _rmdir_when_empty(group: Path, timeout: float = 10) -> None:
    """Remove a cgroup once its last process has gone (a killed process leaves it a moment later)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            group.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class BootedRoot:
    """An overlay of ``lower`` under ``workdir``, booted with ``boot()`` and stopped with ``poweroff()``."""

    def __init__(self, lower: Path, workdir: Path, name: str) -> None:
        self.lower = lower
        self.name = name
        self.workdir = workdir
        self.merged = workdir / "merged"
        self.log_path = workdir / "nspawn.log"
        self.cgroup = f"nodeagent-boot-{name}-{os.getpid()}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.boots = 0
        for sub in ("upper", "ovl-work", "merged"):
            (workdir / sub).mkdir(parents=True, exist_ok=True)
        opts = f"lowerdir={lower},upperdir={workdir / 'upper'},workdir={workdir / 'ovl-work'}"
        subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", opts, str(self.merged)],
            check=True,
            capture_output=True,
            timeout=30,
        )
        for d in _cgroup_dirs(self.cgroup):
            d.mkdir(exist_ok=True)

    # --- boot and shutdown ---------------------------------------------------------------------------
    def boot(self, timeout: float = 60) -> float:
        """Boot the root; returns once systemd finished starting up (seconds it took)."""
        if self.proc is not None and self.proc.poll() is None:
            raise BootError(f"{self.name} is running already")
        start = time.monotonic()
        join = " ; ".join(f"echo $$ > {d / 'cgroup.procs'}" for d in _cgroup_dirs(self.cgroup))
        nspawn = [
            "systemd-nspawn",
            "-D",
            str(self.merged),
            "--boot",
            "--register=no",
            "--keep-unit",
            "--console=read-only",
            "--private-network",
            f"--machine={self.name}",
        ]
        env = dict(os.environ, SYSTEMD_NSPAWN_UNIFIED_HIERARCHY="1", SYSTEMD_COLORS="0")
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                ["sh", "-c", f'{join} ; exec "$@"', "sh", *nspawn],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        finally:
            log.close()
        self.boots += 1
        deadline = start + timeout
        while not (Path(f"/proc/{self._pid1_or_0()}/root/run/systemd/private").exists()):
            if self.proc.poll() is not None:
                raise BootError(f"systemd-nspawn exited with {self.proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise BootError(
                    f"no /run/systemd/private in the container after {timeout}s: {self.log_tail()}"
                )
            time.sleep(0.1)
        left = max(1.0, deadline - time.monotonic())
        state = self.run(
            ["systemctl", "is-system-running", "--wait"], timeout=left, check=False
        ).stdout.strip()
        if state not in ("running", "degraded"):
            raise BootError(f"system state {state!r} after boot: {self.log_tail()}")
        return time.monotonic() - start

    def _pid1_or_0(self) -> int:
        try:
            return self.pid1()
        except BootError:
            return 0

    def pid1(self) -> int:
        """The host PID of the container's systemd (the child of systemd-nspawn)."""
        if self.proc is None:
            raise BootError("not booted")
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        try:
            pids = children.read_text().split()
        except OSError as e:
            raise BootError(f"systemd-nspawn is gone: {e}") from e
        if not pids:
            raise BootError("systemd-nspawn has no child yet")
        return int(pids[0])

    def host_pid(self, pid: int) -> int:
        """This host's PID of the container's process ``pid``."""
        ns = os.readlink(f"/proc/{self.pid1()}/ns/pid")
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                nspid = next(
                    (ln.split()[1:] for ln in status.read_text().splitlines() if ln.startswith("NSpid:")), []
                )
                if nspid and nspid[-1] == str(pid) and os.readlink(status.parent / "ns/pid") == ns:
                    return int(status.parent.name)
            except OSError:
                continue
        raise BootError(f"no process {pid} in {self.name}")

    def poweroff(self, timeout: float = 60) -> None:
        """`systemctl poweroff` in the container; waits for nspawn to end (killing what is left after
        ``timeout``)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.run(["systemctl", "--no-block", "poweroff"], timeout=20, check=False)
        except (BootError, subprocess.TimeoutExpired):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill_all()
            self.proc.wait(timeout=30)
            raise BootError(f"{self.name} did not power off within {timeout}s: {self.log_tail()}") from None

    def _kill_all(self) -> None:
        for d in _cgroup_dirs(self.cgroup):
            kill = d / "cgroup.kill"
            if kill.exists():
                kill.write_text("1")
                continue
            for procs in d.rglob("cgroup.procs"):
                for pid in procs.read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)

    def close(self) -> None:
        """Stop the container if it runs, remove its cgroups, unmount the overlay."""
        try:
            self.poweroff()
        finally:
            if self.proc is not None and self.proc.poll() is None:
                self._kill_all()
                self.proc.wait(timeout=30)
            for d in _cgroup_dirs(self.cgroup):
                if d.exists():
                    for group in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                        _rmdir_when_empty(group)
                    _rmdir_when_empty(d)
            unmounted = subprocess.run(
                ["umount", str(self.merged)], check=False, capture_output=True, timeout=60
            )
            if unmounted.returncode == 0:  # what the machine wrote (the package's venv: ~150 MB) goes now
                for layer in ("upper", "ovl-work"):
                    shutil.rmtree(self.workdir / layer, ignore_errors=True)
            shutil.rmtree(Path("/run/systemd/nspawn/propagate") / self.name, ignore_errors=True)

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no nspawn log)"
        return "\n".join(lines[-n:])

    # --- inside the container ------------------------------------------------------------------------
    def path(self, inside: str) -> Path:
        """A path of the running container as this host sees it (its own /run and /tmp included)."""
        return Path(f"/proc/{self.pid1()}/root") / inside.lstrip("/")

    def run(
        self, cmd: Sequence[str], timeout: float = 60, check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` in the container (all its namespaces, its root, a clean environment)."""
        extra = [f"{k}={v}" for k, v in (env or {}).items()]
        full = [
            "nsenter",
            "-t",
            str(self.pid1()),
            "-a",
            "/usr/bin/env",
            "-i",
            f"PATH={CONTAINER_PATH}",
            "LANG=C.UTF-8",
            "SYSTEMD_COLORS=0",
            "SYSTEMD_PAGER=",
            *extra,
            *cmd,
        ]
        proc = subprocess.run(full, capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """`systemctl show -p ...` of ``unit`` as a dict."""
        out = self.run(["systemctl", "show", unit, *(f"--property={p}" for p in props)]).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, *args: str) -> list[JournalEntry]:
        """This boot's journal (``journalctl -b`` plus ``args``), oldest first."""
        out = self.run(["journalctl", "-b", "--no-pager", "-o", "json", *args], timeout=60).stdout
        entries: list[JournalEntry] = []
        for seq, line in enumerate(out.splitlines()):
            raw = json.loads(line)
            msg = raw.get("MESSAGE", "")
            if isinstance(msg, list):  # journald stores non-UTF-8 messages as byte arrays
                msg = bytes(msg).decode(errors="replace")
            unit = raw.get("UNIT") or raw.get("_SYSTEMD_UNIT") or ""
            entries.append(
                JournalEntry(
                    seq,
                    int(raw.get("__MONOTONIC_TIMESTAMP", 0)),
                    unit,
                    raw.get("SYSLOG_IDENTIFIER", ""),
                    str(msg),
                    raw,
                )
            )
        return entries

    def wait_for(
        self, what: str, predicate: Callable[[], T | None], timeout: float, interval: float = 0.5
    ) -> T:
        """Poll ``predicate()`` until it returns something true; AssertionError naming ``what`` on timeout."""
        deadline = time.monotonic() + timeout
        last: T | None = None
        while time.monotonic() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(interval)
        raise AssertionError(f"{what}: not within {timeout}s (last: {last!r})")
