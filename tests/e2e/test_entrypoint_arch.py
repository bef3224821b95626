"""The image's entrypoint (packaging/kubernetes/entrypoint.sh) behind the DaemonSet's ``driver-lib`` volume, on
both architectures of GPU nodes: the host's library directory mounted where packaging/kubernetes/daemonset.yaml
mounts it, the driver's ``libnvidia-ml.so.1`` in the multiarch directory of the node's architecture, and the
entrypoint run in a Debian root of that architecture: Debian 12 amd64, and Debian 13 arm64 (a Grace node's
aarch64) under Debian's qemu-user-static, where ``uname -m`` says aarch64.

The image's Python environment is not in these roots: in its place ``/opt/nodeagent/bin/nodeagent`` is a
probe that reports what the entrypoint handed it and loads ``libnvidia-ml.so.1`` by that name, as NVML's
bindings do. The "driver library" is a shared object of the root's own architecture (the dynamic loader
skips one of another machine), copied under the driver's file name."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from tests.e2e._agent import REPO
from tests.e2e._chroot import OverlayChroot

MANIFESTS = REPO / "packaging/kubernetes"
DRIVER_VERSION = "550.54.15"
# architecture -> (the root's variable, its multiarch triplet, what uname -m says there)
ROOTS = {
    "amd64": ("NODEAGENT_DEBIAN_ROOT", "x86_64-linux-gnu", "x86_64"),
    "arm64": ("NODEAGENT_DEBIAN_ARM64_ROOT", "aarch64-linux-gnu", "aarch64"),
}
OTHER = {"x86_64-linux-gnu": "aarch64-linux-gnu", "aarch64-linux-gnu": "x86_64-linux-gnu"}
PROBE = """#!/bin/sh
echo "machine=$(uname -m)"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
echo "link=$(readlink -f /run/nvml/libnvidia-ml.so.1 2>/dev/null)"
exec python3 -c '
import ctypes, sys
try:
    ctypes.CDLL("libnvidia-ml.so.1")
except OSError as e:
    print("loaded=none", e)
else:
    print("loaded=" + next(ln.split()[-1] for ln in open("/proc/self/maps") if "libnvidia-ml" in ln))
print("args=" + " ".join(sys.argv[1:]))
' "$@"
"""


def driver_lib_volume() -> tuple[str, str]:
    """(the host path, where the containers see it) of the DaemonSet's driver-lib volume, both containers
    mounting it read-only at the same place."""
    ds = next(d for d in yaml.safe_load_all((MANIFESTS / "daemonset.yaml").read_text()) if d)
    pod = ds["spec"]["template"]["spec"]
    host = next(v["hostPath"]["path"] for v in pod["volumes"] if v["name"] == "driver-lib")
    mounts = {(m["mountPath"], m.get("readOnly", False)) for c in pod["initContainers"] + pod["containers"]
              for m in c["volumeMounts"] if m["name"] == "driver-lib"}
    assert len(mounts) == 1, mounts
    (inside, read_only), = mounts
    assert read_only, inside
    return host, inside


def _root(arch: str) -> Path:
    var = ROOTS[arch][0]
    value = os.environ.get(var, "")
    if not value or not Path(value, "etc/os-release").exists():
        pytest.fail(f"{var} is not set or not a root ({value!r}); run `bash tests/testbin/setup.sh`", pytrace=False)
    if arch == "arm64":
        binfmt = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
        if not binfmt.exists() or "enabled" not in binfmt.read_text():
            pytest.fail("aarch64 programs have no binfmt_misc entry: run tests/testbin/setup.sh "
                        "(step nodeagent_peers_arm64_root registers qemu-user-static's)", pytrace=False)
    return Path(value)


def _host_usr_lib(lower: Path, where: Path, triplets: tuple[str, ...]) -> Path:
    """A host's /usr/lib with the driver's NVML in each of ``triplets``, as the driver installs it: the
    versioned file and its soname link. The file is a shared object of ``lower``'s architecture."""
    own = next(p for name in ("libz.so.1", "libexpat.so.1", "libffi.so.8")
               for p in lower.glob(f"usr/lib/*-linux-gnu/{name}"))
    for triplet in triplets:
        d = where / triplet
        d.mkdir(parents=True)
        shutil.copy(own.resolve(), d / f"libnvidia-ml.so.{DRIVER_VERSION}")
        (d / "libnvidia-ml.so.1").symlink_to(f"libnvidia-ml.so.{DRIVER_VERSION}")
    return where


def _run_entrypoint(lower: Path, workdir: Path, host_lib: Path) -> dict[str, str]:
    _, inside = driver_lib_volume()
    with OverlayChroot(lower, workdir) as root:
        shutil.copy(MANIFESTS / "entrypoint.sh", root.merged / "tmp/entrypoint.sh")
        probe = root.merged / "opt/nodeagent/bin/nodeagent"
        probe.parent.mkdir(parents=True)
        probe.write_text(PROBE)
        probe.chmod(0o755)
        root.bind(host_lib, inside)
        out = root.run(["sh", "/tmp/entrypoint.sh", "--root", "/host", "run"], timeout=120).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


@pytest.mark.parametrize("arch", list(ROOTS))
def test_the_entrypoint_finds_the_driver_of_the_nodes_architecture(tmp_path: Path, arch: str) -> None:
    lower = _root(arch)
    _, triplet, machine = ROOTS[arch]
    host_path, inside = driver_lib_volume()
    assert host_path == "/usr/lib", host_path  # the directory _host_usr_lib builds
    # a host with a library in both multiarch directories: the node's own architecture wins
    host_lib = _host_usr_lib(lower, tmp_path / "host-usr-lib", (triplet, OTHER[triplet]))
    seen = _run_entrypoint(lower, tmp_path / "root", host_lib)
    want = f"{inside}/{triplet}/libnvidia-ml.so.{DRIVER_VERSION}"
    assert seen["machine"] == machine, seen
    assert seen["LD_LIBRARY_PATH"] == "/run/nvml", seen
    assert seen["link"] == want, seen
    # the dynamic loader found it by its soname, where the entrypoint linked it
    assert seen["loaded"] == want, seen
    assert seen["args"] == "--root /host run", seen


def test_the_arm64_entrypoint_takes_no_library_of_another_architecture(tmp_path: Path) -> None:
    """An arm64 node whose library directory has only x86_64-linux-gnu's NVML (what the DaemonSet mounted when
    it named that directory): nothing is linked, the library path stays as it was, the loader finds none."""
    lower = _root("arm64")
    host_lib = _host_usr_lib(lower, tmp_path / "host-usr-lib", ("x86_64-linux-gnu",))
    seen = _run_entrypoint(lower, tmp_path / "root", host_lib)
    assert seen["machine"] == "aarch64", seen
    assert seen["LD_LIBRARY_PATH"] == "" and seen["link"] == "", seen
    assert seen["loaded"].startswith("none "), seen
