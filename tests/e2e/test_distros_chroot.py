"""The .deb in chroots (no systemd, no host paths owned: these run beside the host-owning tests): the
packages' wheels per architecture, the unit tests under Debian 13's Python 3.13, Debian 12 with the image's
entrypoint, and the arm64 package under qemu-user-static. The booted Debian 13 is test_distros.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e._agent import REPO
from tests.e2e._chroot import OverlayChroot
from tests.e2e._distros import MACHINES, PYTHONS, build_debs, elf_machine, links_in, os_release, peer


@pytest.fixture(scope="module")
def debs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_debs(tmp_path_factory, tuple(MACHINES))


# --- the packages ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(MACHINES))
def test_package_carries_the_wheels_of_every_supported_python(debs: dict[str, Path], arch: str) -> None:
    deb = debs[arch]
    assert deb.name.endswith(f"_{arch}.deb")
    info = subprocess.run(["dpkg-deb", "--field", str(deb), "Architecture", "Depends"], capture_output=True,
                          text=True, check=True).stdout
    assert f"Architecture: {arch}" in info, info
    depends = re.search(r"^Depends: (.*)$", info, re.M)
    assert depends is not None, info
    assert {"python3 (>= 3.10)", "python3-venv"} <= {d.strip() for d in depends.group(1).split(",")}, info
    assert "python3." not in depends.group(1), info  # no one Python version
    listing = subprocess.run(["dpkg-deb", "--contents", str(deb)], capture_output=True, text=True,
                             check=True).stdout
    wheels = re.findall(r"\./usr/lib/nodeagent/wheels/(\S+\.whl)", listing)
    assert any(w.startswith("nodeagent-") for w in wheels) and any(w.startswith("installer-") for w in wheels)
    assert not [w for w in wheels if w.startswith("pip-")], wheels  # no resolver at install time
    # per CPython, the wheels pip chose at build time, each one in the package, nodeagent's own left out
    for py in PYTHONS:
        names = subprocess.run(["sh", "-c", f"dpkg-deb --fsys-tarfile {deb} | tar -xO "
                                f"./usr/lib/nodeagent/wheels/{py}.txt"], capture_output=True, text=True,
                               check=True).stdout.split()
        assert names and set(names) <= set(wheels), (py, set(names) - set(wheels))
        assert not [n for n in names if n.startswith(("nodeagent-", "installer-"))], names
        for binary in ("grpcio", "pyyaml"):
            chosen = [n for n in names if n.startswith(f"{binary}-")]
            assert len(chosen) == 1 and f"-{py}-" in chosen[0], (py, chosen)
    machine = MACHINES[arch]
    for binary in ("grpcio", "pyyaml", "charset_normalizer"):
        for py in PYTHONS:
            assert [w for w in wheels if w.startswith(f"{binary}-") and f"-{py}-" in w and w.endswith(
                f"_{machine}.whl")], (binary, py, wheels)
    other = {m for m in MACHINES.values() if m != machine}
    assert not [w for w in wheels if any(m in w for m in other)], wheels
    for path in ("./usr/lib/nodeagent/build-venv", "./usr/bin/nodeagent -> /opt/nodeagent/bin/nodeagent",
                 "./lib/systemd/system/nodeagent.service", "./etc/nodeagent/config.toml"):
        assert path in listing, path
    assert "./opt/nodeagent" not in listing  # made at install time, with the system's python3
    ctrl = subprocess.run(["dpkg-deb", "--info", str(deb), "triggers"], capture_output=True, text=True,
                          check=True).stdout
    assert "interest-noawait /usr/bin/python3" in ctrl, ctrl
    print(f"{arch}: {deb.stat().st_size / 1e6:.1f} MB, {len(wheels)} wheels")


# --- the unit tests under Python 3.13 -------------------------------------------------------------------
# The files of the modules that differ between Python versions (TOML reading, asyncio timeouts, the
# bootstrap's outcomes, UTC times, the CLI): the whole unit suite takes 4 to 13 minutes here, too long for each
# CI run; run it by hand with NODEAGENT_PY313_UNIT=all (tests/unit except test_peer_setup, which drives this
# host's setup.sh).
PY313_UNIT_FILES: tuple[str, ...] = (
    "test_config.py", "test_config_finite.py", "test_bootstrap.py", "test_kube_conditions.py",
    "test_kubelet_watcher.py", "test_dra_service.py", "test_daemon.py", "test_cli_help.py", "test_cli_imports.py",
    "test_runtime_inputs.py",
)
if os.environ.get("NODEAGENT_PY313_UNIT") == "all":
    PY313_UNIT_FILES = tuple(sorted(p.name for p in (REPO / "tests/unit").glob("test_*.py")
                                    if p.name != "test_peer_setup.py"))


@pytest.mark.timeout(900)
def test_unit_tests_pass_under_debian13_python_313(tmp_path: Path) -> None:
    lower = peer("NODEAGENT_DEBIAN13_ROOT", "the Debian 13 root")
    with OverlayChroot(lower, tmp_path / "trixie") as root:
        root.bind(REPO, "/src")
        version = root.run(["/opt/nodeagent-test/bin/python", "-c", "import sys; print(sys.version_info[:2])"])
        assert version.stdout.strip() == "(3, 13)", version.stdout
        start = time.monotonic()
        files = " ".join(f"tests/unit/{name}" for name in PY313_UNIT_FILES)
        proc = root.run(["sh", "-c", "cd /src && exec /opt/nodeagent-test/bin/python -m pytest -p no:cacheprovider "
                         f"-q -x --basetemp /tmp/pt {files}"],
                        env={"PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": "/tmp", "PYTHONPATH": "/src",
                             "HYPOTHESIS_STORAGE_DIRECTORY": "/tmp/hypothesis"}, timeout=900, check=False)
        tail = proc.stdout[-4000:] + proc.stderr[-2000:]
        assert proc.returncode == 0, tail
        summary = proc.stdout.strip().splitlines()[-1]
        assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
        print(f"Python 3.13 (Debian 13): {summary} in {time.monotonic() - start:.0f}s")


# --- Debian 12 and arm64, as chroots --------------------------------------------------------------------
def _chroot_install_and_run(root: OverlayChroot, deb: Path, machine: str, *,
                            discover: bool = True) -> tuple[float, dict[str, Any]]:
    """dpkg -i the package, then its program as a user runs it: ``discover --json`` (unless ``discover`` is
    False: under qemu each start costs 10-30 s of one core, and bootstrap discovers too) and ``bootstrap``;
    returns the install's seconds and what ``discover --json`` printed (or bootstrap's discover step)."""
    shutil.copy(deb, root.merged / "root" / deb.name)
    start = time.monotonic()
    root.run(["dpkg", "-i", f"/root/{deb.name}"], timeout=900)
    took = time.monotonic() - start
    inventory = (json.loads(root.run(["nodeagent", "discover", "--simulate", machine, "--json"]).stdout)
                 if discover else {})
    proc = root.run(["nodeagent", "--root", "/tmp/demo", "bootstrap", "--simulate", machine, "--no-kube"],
                    check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)["steps"]
    steps = {s["step"]: s["result"] for s in report}
    assert steps.get("runtime") == "changed" and "failed" not in steps.values(), steps
    if not discover:
        inventory = next(s for s in report if s["step"] == "discover")["details"]
    assert inventory["gpus"], inventory
    return took, inventory


def _chroot_purge(root: OverlayChroot) -> None:
    root.run(["dpkg", "--purge", "nodeagent"], timeout=300)
    for gone in ("opt/nodeagent", "var/lib/nodeagent", "usr/lib/nodeagent", "etc/nodeagent", "usr/bin/nodeagent"):
        assert not (root.merged / gone).exists(), gone


def test_debian12_chroot_install_run_entrypoint_and_purge(tmp_path: Path, debs: dict[str, Path]) -> None:
    lower = peer("NODEAGENT_DEBIAN_ROOT", "the Debian 12 root")
    assert os_release(lower)["VERSION_ID"] == "12"
    with OverlayChroot(lower, tmp_path / "bookworm") as root:
        took, _ = _chroot_install_and_run(root, debs["amd64"], "dgx-h100")
        print(f"Debian 12: dpkg -i took {took:.1f}s")
        assert "version = 3.11." in (root.merged / "opt/nodeagent/pyvenv.cfg").read_text()
        # the container image's entrypoint execs the same /opt/nodeagent environment
        shutil.copy(REPO / "packaging/kubernetes/entrypoint.sh", root.merged / "tmp/entrypoint.sh")
        assert root.run(["sh", "/tmp/entrypoint.sh", "--version"]).stdout.startswith("nodeagent, version ")
        # a local edit of the conffile survives a reinstall
        (root.merged / "etc/nodeagent/config.toml").write_text('node_name = "edited"\n')
        root.run(["dpkg", "--force-confold", "-i", f"/root/{debs['amd64'].name}"], timeout=600)
        assert (root.merged / "etc/nodeagent/config.toml").read_text() == 'node_name = "edited"\n'
        _chroot_purge(root)


@pytest.mark.timeout(900)
def test_arm64_package_runs_under_qemu_in_an_arm64_root(tmp_path: Path, debs: dict[str, Path]) -> None:
    lower = peer("NODEAGENT_DEBIAN_ARM64_ROOT", "the Debian arm64 root")
    assert elf_machine(lower / "usr/bin/dpkg") == "aarch64"
    binfmt = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    if not binfmt.exists() or "enabled" not in binfmt.read_text():
        pytest.fail("aarch64 programs have no binfmt_misc entry: run tests/testbin/setup.sh "
                    "(step nodeagent_peers_arm64_root registers qemu-user-static's)", pytrace=False)
    with OverlayChroot(lower, tmp_path / "arm64") as root:
        assert root.run(["uname", "-m"]).stdout.strip() == "aarch64"
        took, found = _chroot_install_and_run(root, debs["arm64"], "gb200-nvl", discover=False)
        print(f"arm64 under qemu: dpkg -i took {took:.1f}s")
        # a GB200 NVL node: 4 GPUs; the CDI spec bootstrap wrote names each of them (and "all")
        assert found["gpus"] == 4 and found["driver"], found
        spec = yaml.safe_load((root.merged / "tmp/demo/var/run/cdi/nvidia.yaml").read_text())
        names = [d["name"] for d in spec["devices"]]
        assert {"0", "1", "2", "3", "all"} <= set(names), names
        assert len([n for n in names if n.startswith("GPU-")]) == 4, names
        venv = root.merged / "opt/nodeagent"
        grpc = next(venv.glob("lib/python3.*/site-packages/grpc/_cython/cygrpc*.so"))
        assert elf_machine(grpc) == "aarch64", grpc
        # the venv's python is the root's own python3 (links followed inside the root), an aarch64 program
        chain = links_in(root.merged, "/opt/nodeagent/bin/python")
        assert "/usr/bin/python3" in chain, chain
        assert elf_machine(root.merged / chain[-1].lstrip("/")) == "aarch64", chain
        _chroot_purge(root)
