"""Read-only programs run on the host itself, each bounded in time and output: systemd's view of a unit
(``systemctl show``) and containerd's own reading of its config (``containerd --config FILE config dump``).
``run_bounded`` also runs the MIG hooks (``nodeagent.mig.hooks``).

The one adapter through which ``nodeagent doctor`` executes anything. Its callers build it only when the root
is the real host (``/``): under ``--root`` (an image, another machine's disk, the DaemonSet's ``/host``)
nothing is ever executed, so these facts are then told as not checked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

DEFAULT_TIMEOUT_S = 10.0
MAX_OUTPUT = 1 << 20  # bytes kept of each stream; the rest is read and dropped
UNIT_PROPERTIES = ("LoadState", "ActiveState", "SubState", "Result", "NRestarts")
CONTAINERD_PATHS = ("/usr/bin/containerd", "/usr/local/bin/containerd", "/usr/sbin/containerd")


@dataclass(frozen=True)
class Ran:
    """What a program did: its exit code (None: not started or killed at the time limit), its output cut to
    ``MAX_OUTPUT`` bytes per stream, and why it did not run to its end ("" when it did)."""

    returncode: int | None
    stdout: str
    stderr: str
    problem: str = ""


def run_bounded(argv: Sequence[str], *, timeout: float = DEFAULT_TIMEOUT_S, max_output: int = MAX_OUTPUT,
                env: Mapping[str, str] | None = None, cwd: str | None = None, keep_tail: bool = False) -> Ran:
    """Run ``argv`` with no input, a clean C locale (or ``env``), in ``cwd``, and at most ``timeout`` seconds;
    keep at most ``max_output`` bytes of each stream, its head (or its tail with ``keep_tail``: where a
    program says why it failed), so a program that writes without end is not buffered whole."""
    if env is None:
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LANG": "C", "LC_ALL": "C",
               "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"}
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True)
    except OSError as e:
        where = f" ({e.filename})" if e.filename is not None and e.filename != argv[0] else ""
        return Ran(None, "", "", f"{argv[0]} cannot be run: {e.strerror or e}{where}")
    kept: dict[str, bytes] = {}

    def drain(name: str, stream: IO[bytes]) -> None:
        buf = bytearray()
        while chunk := stream.read(65536):
            if keep_tail:
                buf += chunk
                del buf[: max(0, len(buf) - max_output)]
            elif len(buf) < max_output:
                buf += chunk[: max_output - len(buf)]
        kept[name] = bytes(buf)

    assert proc.stdout is not None and proc.stderr is not None
    readers = [threading.Thread(target=drain, args=(n, s), daemon=True)
               for n, s in (("out", proc.stdout), ("err", proc.stderr))]
    for r in readers:
        r.start()
    problem = ""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        problem = f"{argv[0]} did not end within {timeout:g} s (killed)"
    for r in readers:
        r.join(timeout=2.0)
    for s in (proc.stdout, proc.stderr):
        s.close()
    code = None if problem else proc.returncode
    return Ran(code, kept.get("out", b"").decode("utf-8", "replace"), kept.get("err", b"").decode("utf-8", "replace"),
               problem)


@dataclass(frozen=True)
class UnitState:
    """systemd's properties of a unit (``UNIT_PROPERTIES``), or why they cannot be read."""

    unit: str
    properties: dict[str, str]
    problem: str = ""

    def get(self, name: str) -> str:
        return self.properties.get(name, "")


def unit_state(unit: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> UnitState:
    """``systemctl show -p LoadState,ActiveState,SubState,Result,NRestarts UNIT`` on this host."""
    systemctl = shutil.which("systemctl")
    if systemctl is None:
        return UnitState(unit, {}, "systemctl is not on PATH (no systemd here?)")
    ran = run_bounded([systemctl, "show", "-p", ",".join(UNIT_PROPERTIES), unit], timeout=timeout,
                      max_output=64 << 10)
    if ran.problem:
        return UnitState(unit, {}, ran.problem)
    if ran.returncode != 0:
        return UnitState(unit, {}, _last_line(ran.stderr) or f"systemctl show exited {ran.returncode}")
    props = dict(line.split("=", 1) for line in ran.stdout.splitlines() if "=" in line)
    if not props.get("ActiveState"):
        return UnitState(unit, {}, "systemctl show printed no ActiveState")
    return UnitState(unit, {k: v for k, v in props.items() if k in UNIT_PROPERTIES})


def find_containerd() -> str | None:
    """The containerd program this host runs: the one on PATH, else in one of the usual places."""
    found = shutil.which("containerd")
    if found:
        return found
    return next((p for p in CONTAINERD_PATHS if os.access(p, os.X_OK)), None)


@dataclass(frozen=True)
class ConfigVerdict:
    """containerd's own verdict on a config file: ``loads`` True (it printed the merged config), False (it
    refused; ``message`` is its error), None (it could not be asked; ``message`` says why)."""

    binary: str
    loads: bool | None
    message: str = ""


def containerd_loads(binary: str, config: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> ConfigVerdict:
    """``BINARY --config CONFIG config dump``: containerd reads the file (its imports and drop-ins too) the
    way it would at its start and prints the result, without touching the running daemon."""
    ran = run_bounded([binary, "--config", config, "config", "dump"], timeout=timeout)
    if ran.problem:
        return ConfigVerdict(binary, None, ran.problem)
    if ran.returncode == 0:
        return ConfigVerdict(binary, True)
    return ConfigVerdict(binary, False, _last_line(ran.stderr) or _last_line(ran.stdout)
                         or f"exit code {ran.returncode}")


def _last_line(text: str) -> str:
    """The last non-empty line, cut to 500 characters (a program's error usually ends its output)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""
