"""The .deb on Debian 13 (trixie, Python 3.13) booted by its systemd 257 (``NODEAGENT_DEBIAN13_ROOT``):
`apt-get install` makes /opt/nodeagent with that Python, `nodeagent --version`, `discover --simulate dgx-h100`,
`bootstrap --no-kube` in a sandbox root, both units started by systemd; a change of python3 (its dpkg trigger)
makes the venv again; `apt-get purge` leaves no venv and no state. Debian 12 booted is test_systemd_boot.py;
the package's wheels, Debian 12 and arm64 as chroots and the unit tests under Python 3.13 are
test_distros_chroot.py (they own no host path, so they run beside the host-owning files).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e._distros import APT_ENV, build_debs, os_release, peer
from tests.e2e._nspawn import BootedRoot
from tests.e2e.test_systemd_boot import (
    AGENT,
    AGENT_CONFIG,
    BOOTSTRAP,
    DRIVER_FILES_DROPIN,
    DRIVER_SIM,
    KUBELET_UNIT,
    _driver_kernel_files,
    _readme_gpu_sim_dropin,
)
from tests.peers.hostlock import host_owned


# --- Debian 13, booted by systemd -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def debs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_debs(tmp_path_factory, ("amd64",))


@pytest.fixture(scope="module")
def trixie(tmp_path_factory: pytest.TempPathFactory, debs: dict[str, Path]) -> Iterator[BootedRoot]:
    for tool, package in (("systemd-nspawn", "systemd-container"), ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: apt-get install {package}", pytrace=False)
    lower = peer("NODEAGENT_DEBIAN13_ROOT", "the Debian 13 root")
    assert os_release(lower)["VERSION_ID"] == "13"
    library = Path(os.environ.get("NODEAGENT_NVML_LIBRARY", ""))
    kubelet = Path(os.environ.get("NODEAGENT_KUBELET_HARNESS", ""))
    if not library.is_file() or not kubelet.is_file():
        pytest.fail("NODEAGENT_NVML_LIBRARY / NODEAGENT_KUBELET_HARNESS missing: run tests/testbin/setup.sh",
                    pytrace=False)
    with host_owned("the booted Debian 13 root"):  # one host-owning test at a time
        node = BootedRoot(lower, tmp_path_factory.mktemp("trixie"), f"na13-{os.getpid()}")
        try:
            root = node.merged
            _driver_kernel_files(root / DRIVER_SIM.lstrip("/"))
            shutil.copy(debs["amd64"], root / "root" / debs["amd64"].name)
            shutil.copy(library, root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")
            shutil.copy(kubelet, root / "usr/local/bin/kubelet")
            (root / "var/lib/gpu-sim").mkdir(parents=True, exist_ok=True)
            (root / "etc/systemd/system/kubelet.service").write_text(KUBELET_UNIT)
            for unit in (AGENT, BOOTSTRAP):
                dropin = root / f"etc/systemd/system/{unit}.d/gpu-sim.conf"
                dropin.parent.mkdir(parents=True)
                dropin.write_text(_readme_gpu_sim_dropin() + DRIVER_FILES_DROPIN)
            (root / "etc/nodeagent").mkdir(parents=True, exist_ok=True)
            (root / "etc/nodeagent/config.toml").write_text(AGENT_CONFIG)
            node.boot()
            node.run(["ldconfig"])
            node.run(["systemctl", "start", "kubelet.service"])
            yield node
        finally:
            node.close()


@pytest.mark.timeout(900)
def test_debian13_install_run_units_python_change_and_purge(trixie: BootedRoot, debs: dict[str, Path]) -> None:
    node = trixie
    python = node.run(["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]).stdout.strip()
    assert python == "3.13", python
    start = time.monotonic()
    proc = node.run(["apt-get", "install", "-y", "-q", "-o",
                     "Dpkg::Options::=--force-confold", f"/root/{debs['amd64'].name}"], env=APT_ENV,
                    timeout=300, check=False)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"Debian 13: apt-get install took {took:.1f}s")
    cfg = (node.merged / "opt/nodeagent/pyvenv.cfg").read_text()
    assert re.search(r"^version = 3\.13\.", cfg, re.M), cfg
    assert (node.merged / "opt/nodeagent/lib/python3.13/site-packages/nodeagent").is_dir()
    assert not (node.merged / "opt/nodeagent/bin/pip").exists()
    # the installed program, run as a user would
    assert node.run(["nodeagent", "--version"]).stdout.startswith("nodeagent, version ")
    inventory = json.loads(node.run(["nodeagent", "discover", "--simulate", "dgx-h100", "--json"]).stdout)
    assert len(inventory["gpus"]) == 8 and "H100" in inventory["gpus"][0]["name"], inventory["gpus"][0]
    proc = node.run(["nodeagent", "--root", "/tmp/demo", "bootstrap", "--simulate", "dgx-h100", "--no-kube"],
                    check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert {s["result"] for s in report["steps"]} <= {"changed", "unchanged", "skipped"}, report
    assert node.path("/tmp/demo/etc/containerd/conf.d/99-nvidia.toml").is_file()  # /tmp: a tmpfs there
    # the units, started by systemd (postinst started the agent; the bootstrap runs before a kubelet)
    started = node.run(["systemctl", "start", BOOTSTRAP], timeout=180, check=False)
    assert started.returncode == 0, "\n".join(e.message for e in node.journal("-u", BOOTSTRAP))[-5000:]
    report = json.loads(node.path("/run/nodeagent/bootstrap.json").read_text())
    assert "failed" not in {s["result"] for s in report["steps"]}, report
    node.wait_for("nodeagent.service active", lambda: node.show(AGENT, "ActiveState")["ActiveState"] == "active",
                  90)
    # a new python3 (the distribution's upgrade): the trigger makes the venv again with it
    pyvenv = node.merged / "opt/nodeagent/pyvenv.cfg"
    pyvenv.write_text(re.sub(r"^version = .*$", "version = 3.12.0", cfg, flags=re.M))
    node.run(["dpkg-trigger", "--no-await", "/usr/bin/python3"])
    proc = node.run(["dpkg", "--triggers-only", "--pending"], timeout=300)
    assert pyvenv.read_text() == cfg or re.search(r"^version = 3\.13\.", pyvenv.read_text(), re.M)
    assert "made by Python 3.12, python3 is 3.13" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    node.wait_for("nodeagent.service active again", lambda: node.show(AGENT, "ActiveState")["ActiveState"]
                  == "active", 90)
    # ... and each start of a unit checks it first, for a Python changed without dpkg (the same script)
    for unit in (AGENT, BOOTSTRAP):
        pre = node.run(["systemctl", "show", unit, "--property=ExecStartPre"]).stdout  # one line per command
        assert "argv[]=/usr/lib/nodeagent/build-venv --if-stale" in pre, pre
    # purge: the venv postinst made, the state and the units go
    node.run(["apt-get", "purge", "-y", "-q", "nodeagent"], env=APT_ENV, timeout=120)
    for gone in ("opt/nodeagent", "var/lib/nodeagent", "usr/lib/nodeagent", "lib/systemd/system/nodeagent.service",
                 "etc/nodeagent/config.toml"):
        assert not (node.merged / gone).exists(), gone
    assert node.show(AGENT, "LoadState")["LoadState"] == "not-found"


