"""Debian's real containerd: validate/dump a config, or run it in a temp directory and see what it loaded."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomlkit

from tests.peers._proc import stop_process, tail
from tests.peers._resolve import PeerMissingError, system_binary

if sys.version_info >= (3, 11):
    import tomllib
else:  # the backport of the same parser
    import tomli as tomllib

BOOT_TIMEOUT = 30.0
CRI_PLUGINS = ("io.containerd.grpc.v1.cri", "cri", "io.containerd.cri.v1.runtime")


class ContainerdConfigError(RuntimeError):
    """containerd rejected a config file; the message is containerd's own (with line/column)."""


def containerd_binary() -> Path:
    import os

    value = os.environ.get("NODEAGENT_CONTAINERD")
    if value:
        return Path(value)
    return system_binary("containerd", "containerd")


# --- parsing Go's %+v rendering of the CRI config (the "Start cri plugin with config" log line) ------

def _split_top(text: str, sep: str = " ") -> list[str]:
    """Split on ``sep`` outside [], {} nesting."""
    parts: list[str] = []
    depth = 0
    cur: list[str] = []
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == sep and depth == 0:
            if cur:
                parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        parts.append("".join(cur))
    return parts


def _bracketed(text: str, start: int) -> str:
    """The text between the bracket at ``start`` and its partner (exclusive)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "[{":
            depth += 1
        elif text[i] in "]}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
    raise ValueError("unbalanced brackets in containerd's CRI config line")


def _go_value(raw: str) -> Any:
    if raw.startswith("map[") and raw.endswith("]"):
        return _go_map(raw[4:-1])
    if raw.startswith("{") and raw.endswith("}"):
        return _go_struct(raw[1:-1])
    if raw.startswith("[") and raw.endswith("]"):
        return [_go_value(p) for p in _split_top(raw[1:-1])]
    return raw


def _go_map(body: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in _split_top(body):
        key, _, value = item.partition(":")
        out[key] = _go_value(value)
    return out


def _go_struct(body: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    key: str | None = None
    for item in _split_top(body):
        k, sep, value = item.partition(":")
        if sep and k.isidentifier() and k[:1].isupper():
            key = k
            out[key] = _go_value(value)
        elif key is not None:  # a plain value with a space in it
            out[key] = f"{out[key]} {item}"
    return out


def parse_cri_runtimes(log_line: str) -> dict[str, dict[str, Any]]:
    """Runtime handlers from the CRI plugin's config log line: name -> fields (``Type``, ``Options``...)."""
    marker = "Runtimes:map["
    at = log_line.find(marker)
    if at < 0:
        raise ValueError("no Runtimes in containerd's CRI config line")
    body = _bracketed(log_line, at + len(marker) - 1)
    runtimes = _go_map(body)
    return {name: value if isinstance(value, dict) else {"raw": value} for name, value in runtimes.items()}


def _cri_field(log_line: str, name: str) -> str | None:
    marker = f" {name}:"
    at = log_line.find(marker)
    if at < 0:
        return None
    rest = log_line[at + len(marker):]
    return _split_top(rest)[0] if rest and not rest.startswith(" ") else ""


@dataclass
class RunningContainerd:
    """A containerd started on a rewritten copy of a config; ``runtimes`` is what its CRI plugin loaded."""

    address: Path
    config: Path
    workdir: Path
    runtimes: dict[str, dict[str, Any]]
    default_runtime: str | None
    cri_config_line: str
    cri_error: str | None
    _proc: subprocess.Popen[bytes] = field(repr=False)

    def log(self) -> str:
        return (self.workdir / "containerd.log").read_text(errors="replace")

    def ctr(self, *args: str) -> str:
        proc = subprocess.run(["ctr", "--address", str(self.address), *args], capture_output=True, text=True,
                              check=False, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout

    def stop(self) -> None:
        stop_process(self._proc)


def _absolute_imports(doc: Any, base: Path) -> None:
    imports = doc.get("imports")
    if imports is None:
        return
    doc["imports"] = [str(base / p) if not Path(str(p)).is_absolute() else str(p) for p in imports]


def _with_top_level(doc: Any, values: dict[str, Any]) -> str:
    """``doc`` rendered with ``values`` as top-level keys. They go first in the file: after a table header
    or a dotted ``plugins.…`` key tomlkit would insert them where TOML reads them as keys of a table."""
    for key in values:
        if key in doc:
            del doc[key]
    return tomlkit.dumps(values) + tomlkit.dumps(doc)


class Containerd:
    """Entry point of the ``containerd`` fixture (``binary``: another containerd build, e.g. containerd 2)."""

    def __init__(self, workdir: Path, binary: Path | None = None) -> None:
        self.binary = binary if binary is not None else containerd_binary()
        self.workdir = workdir
        self._running: list[RunningContainerd] = []
        self._count = 0

    def version(self) -> str:
        return subprocess.run([str(self.binary), "--version"], capture_output=True, text=True,
                              check=True).stdout.strip()

    def config_dump(self, path: Path) -> dict[str, Any]:
        """The effective config containerd derives from ``path`` (defaults and imports merged)."""
        proc = subprocess.run([str(self.binary), "--config", str(path), "config", "dump"],
                              capture_output=True, text=True, check=False, timeout=30)
        if proc.returncode != 0:
            raise ContainerdConfigError((proc.stderr or proc.stdout).strip())
        return tomllib.loads(proc.stdout)

    def start(self, path: Path) -> RunningContainerd:
        """Run containerd on ``path`` with root, state, sockets and /opt moved into a temp directory;
        returns once it has booted. Stopped by the fixture at the end of the test."""
        self._count += 1
        wd = self.workdir / f"containerd-{self._count}"
        wd.mkdir(parents=True)
        doc = tomlkit.parse(path.read_text())
        _absolute_imports(doc, path.resolve().parent)
        top: dict[str, Any] = {"root": str(wd / "root"), "state": str(wd / "state")}
        if "imports" in doc:
            top["imports"] = doc["imports"].unwrap()
        address = wd / "containerd.sock"
        for table, key, value in (("grpc", "address", str(address)), ("ttrpc", "address", str(wd / "ttrpc.sock")),
                                  ("debug", "address", ""), ("metrics", "address", "")):
            section = doc.get(table)
            if section is None:
                section = tomlkit.table()
                doc[table] = section
            section[key] = value
        if int(doc.get("version", 1)) >= 2:
            plugins = doc.setdefault("plugins", tomlkit.table())
            opt = plugins.setdefault("io.containerd.internal.v1.opt", tomlkit.table())
            opt["path"] = str(wd / "opt")
        self._isolate(doc, wd)
        config = wd / "config.toml"
        config.write_text(_with_top_level(doc, top))
        log_path = wd / "containerd.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen([str(self.binary), "--config", str(config), "--log-level", "info"],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + BOOT_TIMEOUT
        text = ""
        while time.monotonic() < deadline:
            text = log_path.read_text(errors="replace")
            if "containerd successfully booted" in text:
                break
            if proc.poll() is not None:
                raise ContainerdConfigError(f"containerd exited with {proc.returncode}:\n{tail(log_path)}")
            time.sleep(0.05)
        else:
            stop_process(proc)
            raise RuntimeError(f"containerd did not boot in {BOOT_TIMEOUT:.0f}s:\n{tail(log_path)}")
        cri_error = next((ln for ln in text.splitlines()
                          if "failed to load plugin" in ln and any(p in ln for p in CRI_PLUGINS)), None)
        cri_line, runtimes, default_runtime = self._cri_report(text)
        running = RunningContainerd(
            address=address, config=config, workdir=wd, runtimes=runtimes, default_runtime=default_runtime,
            cri_config_line=cri_line, cri_error=cri_error, _proc=proc,
        )
        self._running.append(running)
        return running

    def _isolate(self, doc: Any, wd: Path) -> None:
        """Hook: move further host-global paths of this containerd build into ``wd``."""

    def _cri_report(self, log_text: str) -> tuple[str, dict[str, dict[str, Any]], str | None]:
        """(CRI config log line, runtime handlers, default runtime) from containerd's boot log."""
        line = next((ln for ln in log_text.splitlines() if "Start cri plugin with config" in ln), "")
        if not line:
            return "", {}, None
        return line, parse_cri_runtimes(line), _cri_field(line, "DefaultRuntimeName")

    def stop_all(self) -> None:
        for r in self._running:
            r.stop()
        self._running.clear()


@contextlib.contextmanager
def containerd_peer(factory: Callable[[Path], Containerd] = Containerd) -> Iterator[Containerd]:
    wd = Path(tempfile.mkdtemp(prefix="nodeagent-containerd-"))
    try:
        peer = factory(wd)
        try:
            yield peer
        finally:
            peer.stop_all()
    finally:
        # containerd may leave overlay/tmpfs mounts under its root; unmount before removing.
        subprocess.run(["sh", "-c", f"grep -o ' {wd}[^ ]*' /proc/self/mounts | sort -r | xargs -r -n1 umount -l"],
                       check=False, capture_output=True)
        shutil.rmtree(wd, ignore_errors=True)


__all__ = ["Containerd", "ContainerdConfigError", "PeerMissingError", "RunningContainerd", "containerd_peer",
           "parse_cri_runtimes"]
