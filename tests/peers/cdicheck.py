"""cdi-check: the CDI reference library (tags.cncf.io/container-device-interface/pkg/cdi) as a test peer.

``run_cdi_check(spec_dirs, groups, annotations)`` loads the spec directories, lists the devices and
injects each group of names (and each annotation) into an empty OCI spec; the JSON answer is returned.
``CdiResolver(spec_dirs)`` keeps one cdi-check running with its cache (``-serve``), as containerd keeps
its own: ``resolve(names)`` refreshes the cache from the directories and injects the names.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.peers._resolve import peer_binary


def cdi_check_binary() -> Path:
    return peer_binary("NODEAGENT_CDI_CHECK", "nodeagent_peers_cdi_check", "cdi-check (CDI reference library)")


def run_cdi_check(
    spec_dirs: Sequence[Path],
    groups: Sequence[Sequence[str]] = (),
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    args = [str(cdi_check_binary())]
    for d in spec_dirs:
        args += ["-spec-dir", str(d)]
    for g in groups:
        args += ["-inject", ",".join(g)]
    for k, v in (annotations or {}).items():
        args += ["-annotation", f"{k}={v}"]
    proc = subprocess.run(args, capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0, f"cdi-check failed ({proc.returncode}): {proc.stderr}"
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


class CdiResolver:
    """A long-lived ``cdi-check -serve``; use as a context manager."""

    def __init__(self, spec_dirs: Sequence[Path]) -> None:
        args = [str(cdi_check_binary()), "-serve"]
        for d in spec_dirs:
            args += ["-spec-dir", str(d)]
        self._proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def resolve(self, names: Sequence[str]) -> dict[str, Any]:
        """``{"errors": {spec file: [...]}, "injection": {"devices", "unresolved", "error"?}}``."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(",".join(names) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        assert line, f"cdi-check -serve ended (exit {self._proc.poll()})"
        out: dict[str, Any] = json.loads(line)
        return out

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> CdiResolver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _binary(env_var: str, what: str) -> Path:
    return peer_binary(env_var, "nodeagent_peers_cdi_check", what)


def cri_cdi_binary() -> Path:
    return _binary("NODEAGENT_CRI_CDI", "cri-cdi (CRI client, tests/testbin/cdi-check/cmd/cri-cdi)")


def pause_binary() -> Path:
    return _binary("NODEAGENT_CDI_PAUSE", "the test image's pause (tests/testbin/cdi-check/cmd/pause)")


def containerd2_shim_binary() -> Path:
    return _binary("NODEAGENT_CONTAINERD2_SHIM", "containerd 2's containerd-shim-runc-v2")


def run_cri_cdi(address: Path, image: str, cdi_devices: Sequence[str] = (),
                annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Create a container through CRI with these CDI devices / annotations; the OCI spec containerd made."""
    args = [str(cri_cdi_binary()), "-address", str(address), "-image", image, "-cdi", ",".join(cdi_devices)]
    for k, v in (annotations or {}).items():
        args += ["-annotation", f"{k}={v}"]
    proc = subprocess.run(args, capture_output=True, text=True, check=False, timeout=180)
    assert proc.returncode == 0, f"cri-cdi failed ({proc.returncode}): {proc.stderr}"
    spec: dict[str, Any] = json.loads(proc.stdout)["runtime_spec"]
    return spec
