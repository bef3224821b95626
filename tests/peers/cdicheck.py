"""cdi-check: the CDI reference library (tags.cncf.io/container-device-interface/pkg/cdi) as a test peer.

``run_cdi_check(spec_dirs, groups, annotations)`` loads the spec directories, lists the devices and
injects each group of names (and each annotation) into an empty OCI spec; the JSON answer is returned.
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
