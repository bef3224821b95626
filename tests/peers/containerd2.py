"""containerd 2 (config versions 3 and 4), built from github.com/containerd/containerd/v2 by setup.sh.

Same API as the ``containerd`` fixture (``config_dump``, ``start``, ``version``); the differences are what
containerd 2 changed:

* the CRI runtime plugin (``io.containerd.cri.v1.runtime``) logs its effective config as JSON
  (``msg="starting cri plugin" config="{…}"``) instead of Go's ``%+v``;
* version 4 configs set the sockets in ``plugins."io.containerd.server.v1.*"`` (the top-level ``[grpc]``,
  ``[ttrpc]``, ``[debug]``, ``[metrics]`` tables only count when those plugin tables are absent), and NRI
  (on by default) has its own socket; all are moved into the temp directory;
* ``cri_status(running)`` asks the running CRI service itself, over the CRI API the kubelet uses
  (``RuntimeService.Status``, verbose), which runtime handlers it serves and with what config
  (the helper ``cri-status``, tests/testbin/containerd2/cmd/cri-status).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomlkit

from tests.peers._resolve import peer_binary
from tests.peers.containerd import Containerd, RunningContainerd

WHAT = "containerd 2 (built from github.com/containerd/containerd/v2 by tests/testbin/setup.sh)"
# Plugins that listen on a host-global socket: plugin id -> the temp-dir file name for it.
SERVER_SOCKETS = {
    "io.containerd.server.v1.grpc": "containerd.sock",
    "io.containerd.server.v1.ttrpc": "ttrpc.sock",
    "io.containerd.server.v1.debug": "",
    "io.containerd.server.v1.metrics": "",
    "io.containerd.nri.v1.nri": "nri.sock",
}
_CRI_LINE = re.compile(r'msg="starting cri plugin".*?\bconfig="((?:[^"\\]|\\.)*)"')


def containerd2_binary() -> Path:
    return peer_binary("NODEAGENT_CONTAINERD2", "nodeagent_peers_containerd2", WHAT)


def cri_status_binary() -> Path:
    return peer_binary("NODEAGENT_CRI_STATUS", "nodeagent_peers_containerd2", "the cri-status helper")


def _go_unquote(quoted: str) -> str:
    """Undo the Go ``%q`` quoting logrus applies to a field value (ASCII JSON: \\" \\\\ \\n \\t, \\uXXXX)."""
    text: str = json.loads(f'"{quoted}"')
    return text


def parse_cri_config(log_text: str) -> tuple[str, dict[str, Any] | None]:
    """(log line, CRI runtime config) from containerd 2's ``starting cri plugin`` log line."""
    for line in log_text.splitlines():
        m = _CRI_LINE.search(line)
        if m:
            config = json.loads(_go_unquote(m.group(1)))
            return line, config if isinstance(config, dict) else None
    return "", None


@dataclass(frozen=True)
class CriStatus:
    """What a running containerd's CRI service answers to ``Status`` (verbose)."""

    handlers: tuple[str, ...]  # "" is the default handler
    conditions: dict[str, bool]
    config: dict[str, Any]

    @property
    def runtimes(self) -> dict[str, dict[str, Any]]:
        runtimes = self.config.get("containerd", {}).get("runtimes", {})
        return runtimes if isinstance(runtimes, dict) else {}

    @property
    def default_runtime(self) -> str | None:
        name = self.config.get("containerd", {}).get("defaultRuntimeName")
        return name if isinstance(name, str) else None


class Containerd2(Containerd):
    """Entry point of the ``containerd2`` fixture."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, binary=containerd2_binary())

    def version_tuple(self) -> tuple[int, int, int]:
        m = re.search(r"\bv?(\d+)\.(\d+)\.(\d+)", self.version().split(maxsplit=2)[-1])
        if m is None:
            raise RuntimeError(f"cannot read containerd's version from {self.version()!r}")
        return int(m.group(1)), int(m.group(2)), int(m.group(3))

    def _isolate(self, doc: Any, wd: Path) -> None:
        plugins = doc.setdefault("plugins", tomlkit.table())
        for plugin_id, name in SERVER_SOCKETS.items():
            table = plugins.setdefault(plugin_id, tomlkit.table())
            table["socket_path" if plugin_id.startswith("io.containerd.nri.") else "address"] = (
                str(wd / name) if name else "")

    def _cri_report(self, log_text: str) -> tuple[str, dict[str, dict[str, Any]], str | None]:
        line, config = parse_cri_config(log_text)
        if config is None:
            return line, {}, None
        runtimes = config.get("containerd", {}).get("runtimes", {})
        default = config.get("containerd", {}).get("defaultRuntimeName")
        return line, {str(k): _go_style(v) for k, v in runtimes.items()}, default if isinstance(default, str) else None

    def cri_status(self, running: RunningContainerd) -> CriStatus:
        """Ask the running containerd's CRI service (``RuntimeService.Status``, verbose)."""
        proc = subprocess.run([str(cri_status_binary()), str(running.address)], capture_output=True, text=True,
                              check=False, timeout=60, env={**os.environ, "GRPC_GO_LOG_SEVERITY_LEVEL": "error"})
        if proc.returncode != 0:
            raise RuntimeError(f"CRI Status on {running.address} failed: {proc.stderr.strip()}")
        out = json.loads(proc.stdout)
        return CriStatus(
            handlers=tuple(h["name"] for h in out["runtime_handlers"]),
            conditions={c["type"]: c["status"] for c in out["conditions"]},
            config=out["config"] if isinstance(out["config"], dict) else {},
        )


def _go_style(runtime: Any) -> dict[str, Any]:
    """A runtime from the JSON config with the keys the 1.x fixture reports (``Type``, ``Options``...)."""
    if not isinstance(runtime, dict):
        return {"raw": runtime}
    out = {k[:1].upper() + k[1:]: v for k, v in runtime.items()}
    if "RuntimeType" in out and "Type" not in out:
        out["Type"] = out["RuntimeType"]
    return out


__all__ = ["Containerd2", "CriStatus", "containerd2_binary", "parse_cri_config"]
