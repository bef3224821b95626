"""Delivery: the systemd units pass `systemd-analyze verify`; the .deb builds from a fresh clone and holds what
it should (installed and run in real Debian roots: tests/e2e/test_distros.py, test_systemd_boot.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e._agent import REPO

UNITS = ("nodeagent.service", "nodeagent-bootstrap.service")


def need(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is missing: apt-get install {package}", pytrace=False)
    return path


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = need("systemd-analyze", "systemd")
    system_units = Path("/lib/systemd/system")
    if not (system_units / "sysinit.target").exists():
        pytest.fail("systemd's own units are missing: apt-get install systemd", pytrace=False)
    # A throwaway root holding the system's units, ours, and the binaries our Exec lines name.
    root = tmp_path / "root"
    shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    for unit in UNITS:
        shutil.copy(REPO / "systemd" / unit, root / "etc/systemd/system" / unit)
    for exe in ("usr/bin/nodeagent", "bin/kill", "usr/lib/nodeagent/build-venv"):
        (root / exe).parent.mkdir(parents=True, exist_ok=True)
        (root / exe).write_text("#!/bin/sh\n")
        (root / exe).chmod(0o755)
    proc = subprocess.run([analyze, "verify", f"--root={root}", *UNITS], capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    # verify reports unknown keys and bad values only as warnings: none may mention our units
    assert not [ln for ln in out.splitlines() if "nodeagent" in ln], out


def test_unit_contract() -> None:
    text = (REPO / "systemd/nodeagent.service").read_text()
    for line in ("Type=notify", "Restart=always", "WatchdogSec=", "ExecReload=/bin/kill -HUP $MAINPID",
                 "After=network-online.target containerd.service", "ReadWritePaths=-/etc/containerd",
                 "/var/lib/kubelet/device-plugins", "DeviceAllow=char-nvidia-frontend rw"):
        assert line in text, line
    after = next(ln for ln in text.splitlines() if ln.startswith("After=")).split("=", 1)[1].split()
    assert {"containerd.service", "kubelet.service", "nodeagent-bootstrap.service"} <= set(after)
    boot = (REPO / "systemd/nodeagent-bootstrap.service").read_text()
    for line in ("Type=oneshot", "Before=kubelet.service", "SuccessExitStatus=3"):
        assert line in boot, line


def _directives(unit: str, key: str) -> list[str]:
    text = (REPO / "systemd" / unit).read_text()
    return [v for ln in text.splitlines() if ln.startswith(key + "=") for v in ln.split("=", 1)[1].split()]


@pytest.mark.parametrize(("unit", "limit"), [("nodeagent.service", 4.0), ("nodeagent-bootstrap.service", 5.0)])
def test_unit_exposure_score(unit: str, limit: float) -> None:
    """`systemd-analyze security --offline=true`: exposure at most 4.0 (agent) and 5.0 (bootstrap)."""
    import re

    analyze = need("systemd-analyze", "systemd")
    proc = subprocess.run([analyze, "security", "--offline=true", "--no-pager", str(REPO / "systemd" / unit)],
                          capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout + proc.stderr)
    assert m is not None, proc.stdout + proc.stderr
    assert float(m.group(1)) <= limit, proc.stdout
    print(f"{unit}: exposure {m.group(1)}")


@pytest.mark.parametrize("unit", UNITS)
def test_unit_least_privilege(unit: str) -> None:
    for key in ("NoNewPrivileges", "ProtectKernelTunables", "PrivateMounts"):
        assert _directives(unit, key) == ["yes"], key
    assert _directives(unit, "ProtectSystem") == ["strict"]
    assert _directives(unit, "UMask") == ["0027"]
    assert set(_directives(unit, "CapabilityBoundingSet")) == {"CAP_SYS_ADMIN", "CAP_CHOWN", "CAP_KILL"}
    assert "@system-service" in _directives(unit, "SystemCallFilter")
    assert _directives(unit, "DevicePolicy") == ["closed"]
    writable = _directives(unit, "ReadWritePaths")
    # every path may be absent on some node (no toolkit, no CDI, no kubelet yet): '-' makes it optional
    assert writable and all(p.startswith("-") for p in writable), writable
    # never all of the kubelet's directory (every pod's secret volumes live below it)
    assert not [p for p in writable if p.rstrip("/").endswith("/var/lib/kubelet")]


def test_bootstrap_never_holds_the_kubelet_back(tmp_path: Path) -> None:
    """Enabled, the bootstrap unit is WANTED by kubelet.service (ordering only): a failed run (driver not
    loaded yet, exit 1; a templated containerd config, exit 2) leaves the unit failed but the kubelet starts."""
    systemctl = need("systemctl", "systemd")
    assert _directives("nodeagent-bootstrap.service", "RequiredBy") == []
    assert "kubelet.service" in _directives("nodeagent-bootstrap.service", "WantedBy")
    assert "kubelet.service" in _directives("nodeagent-bootstrap.service", "Before")
    assert _directives("nodeagent-bootstrap.service", "SuccessExitStatus") == ["3"]
    root = tmp_path / "root"
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    shutil.copy(REPO / "systemd/nodeagent-bootstrap.service", units)
    (units / "kubelet.service").write_text("[Service]\nExecStart=/usr/bin/kubelet\n")
    proc = subprocess.run([systemctl, f"--root={root}", "enable", "nodeagent-bootstrap.service"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (units / "kubelet.service.wants/nodeagent-bootstrap.service").is_symlink()
    assert not (units / "kubelet.service.requires").exists()


@pytest.fixture(scope="module")
def deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need("dpkg-deb", "dpkg")
    out = tmp_path_factory.mktemp("deb")
    proc = subprocess.run(["bash", str(REPO / "packaging/build-deb.sh"), str(out)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert path.exists()
    return path


@pytest.mark.parametrize("venv", [False, True], ids=["no-venv", "quickstart-venv"])
def test_deb_builds_from_a_fresh_clone(tmp_path: Path, venv: bool) -> None:
    """README "Bare metal": `bash packaging/build-deb.sh` in a fresh clone (no test run first): without a
    .venv, and with the .venv the README's quick start makes (no `wheel` package in it), which the build
    must neither depend on nor change."""
    need("dpkg-deb", "dpkg")
    git = need("git", "git")
    clone = tmp_path / "clone"
    subprocess.run([git, "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=120)
    assert not (clone / ".venv").exists()
    no_wheel = [str(clone / ".venv/bin/python"), "-c", "import wheel"]
    if venv:
        subprocess.run(["/usr/bin/python3", "-m", "venv", str(clone / ".venv")], check=True, timeout=120)
        assert subprocess.run(no_wheel, capture_output=True, timeout=60).returncode != 0
    env = {k: v for k, v in os.environ.items() if k not in ("NODEAGENT_BUILD_PYTHON", "VIRTUAL_ENV")}
    proc = subprocess.run(["bash", "packaging/build-deb.sh"], cwd=clone, capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    deb = Path(proc.stdout.strip().splitlines()[-1])
    assert deb.parent == clone / "dist" and deb.exists()
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    assert "./usr/lib/nodeagent/build-venv" in listing and "./lib/systemd/system/nodeagent.service" in listing
    if venv:
        assert subprocess.run(no_wheel, capture_output=True, timeout=60).returncode != 0  # left as it was
    else:
        assert not (clone / ".venv").exists()


def test_deb_contents(deb: Path) -> None:
    info = subprocess.run(["dpkg-deb", "--info", str(deb)], capture_output=True, text=True, check=True).stdout
    assert "Package: nodeagent" in info and "Depends: python3 (>= 3.10), python3-venv" in info
    conffiles = subprocess.run(["dpkg-deb", "--ctrl-tarfile", str(deb)], capture_output=True, check=True).stdout
    assert b"conffiles" in conffiles
    listing = subprocess.run(["dpkg-deb", "--contents", str(deb)], capture_output=True, text=True, check=True).stdout
    for path in ("./usr/lib/nodeagent/build-venv", "./usr/bin/nodeagent -> /opt/nodeagent/bin/nodeagent",
                 "./lib/systemd/system/nodeagent.service", "./lib/systemd/system/nodeagent-bootstrap.service",
                 "./etc/nodeagent/config.toml"):
        assert path in listing, path
    assert "__pycache__" not in listing
