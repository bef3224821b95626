"""What the package tests of several Debian releases and architectures share (test_distros.py, booted;
test_distros_chroot.py, chroots): the roots setup.sh made, the packages built once per module, ELF and
os-release readers."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e._agent import REPO

PYTHONS = ("cp310", "cp311", "cp312", "cp313")
MACHINES = {"amd64": "x86_64", "arm64": "aarch64"}
ELF_MACHINE = {b"\x3e\x00": "x86_64", b"\xb7\x00": "aarch64"}  # e_machine, little-endian
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive"}


def peer(var: str, what: str) -> Path:
    value = os.environ.get(var, "")
    if not value or not Path(value, "etc/os-release").exists():
        pytest.fail(f"{what}: {var} is not set or not a root ({value!r}); run `bash tests/testbin/setup.sh`",
                    pytrace=False)
    return Path(value)


def build(out: Path, arch: str) -> Path:
    start = time.monotonic()
    proc = subprocess.run(["nice", "-n", "10", "bash", str(REPO / "packaging/build-deb.sh"), "--arch", arch,
                           str(out)], capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    deb = Path(proc.stdout.strip().splitlines()[-1])
    print(f"{arch}: built {deb.name} in {time.monotonic() - start:.1f}s, {deb.stat().st_size / 1e6:.1f} MB")
    return deb


def build_debs(tmp_path_factory: pytest.TempPathFactory, arches: tuple[str, ...]) -> dict[str, Path]:
    """The package of each of ``arches``, built once for a test module."""
    if shutil.which("dpkg-deb") is None:
        pytest.fail("dpkg-deb is missing: apt-get install dpkg", pytrace=False)
    out = tmp_path_factory.mktemp("debs")
    return {arch: build(out, arch) for arch in arches}


def os_release(root: Path) -> dict[str, str]:
    text = (root / "etc/os-release").read_text()
    return {k: v.strip('"') for k, v in (ln.split("=", 1) for ln in text.splitlines() if "=" in ln)}


def elf_machine(path: Path) -> str:
    with path.open("rb") as f:
        head = f.read(20)
    assert head[:4] == b"\x7fELF", path
    return ELF_MACHINE.get(head[18:20], head[18:20].hex())


def links_in(root: Path, path: str) -> list[str]:
    """``path`` and each symbolic link it leads to, resolved inside ``root`` (not on this host)."""
    chain = [path]
    while (root / chain[-1].lstrip("/")).is_symlink() and len(chain) < 10:
        target = os.readlink(root / chain[-1].lstrip("/"))
        chain.append(target if target.startswith("/") else os.path.normpath(os.path.join(
            os.path.dirname(chain[-1]), target)))
    return chain
