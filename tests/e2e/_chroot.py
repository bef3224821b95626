"""A Debian root (built and cached by tests/testbin/setup.sh) as a chroot, for what needs no booted systemd.

The root is never written: ``OverlayChroot`` mounts an overlay of it whose upper layer lives in a temporary
directory, with the kernel's /proc, /sys and /dev below it, and runs commands in it with ``chroot`` and a
clean environment. An arm64 root runs the same way on this amd64 host: the kernel hands its aarch64
programs to Debian's qemu-aarch64-static (binfmt_misc, registered by setup.sh).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

CHROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class OverlayChroot:
    """An overlay of ``lower`` mounted under ``workdir``; ``close()`` unmounts it and drops what it wrote."""

    def __init__(self, lower: Path, workdir: Path) -> None:
        self.lower = lower
        self.workdir = workdir
        self.merged = workdir / "merged"
        self._mounts: list[Path] = []
        for sub in ("upper", "ovl-work", "merged"):
            (workdir / sub).mkdir(parents=True, exist_ok=True)
        opts = f"lowerdir={lower},upperdir={workdir / 'upper'},workdir={workdir / 'ovl-work'}"
        self._mount(["-t", "overlay", "overlay", "-o", opts], self.merged)
        try:
            self._mount(["-t", "proc", "proc"], self.merged / "proc")
            self._mount(["-t", "sysfs", "-o", "ro", "sys"], self.merged / "sys")
            self._mount(["--rbind", "/dev"], self.merged / "dev")
            subprocess.run(["mount", "--make-rslave", str(self.merged / "dev")], check=True, timeout=30)
        except BaseException:
            self.close()
            raise

    def _mount(self, args: list[str], target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", *args, str(target)], check=True, capture_output=True, timeout=30)
        self._mounts.append(target)

    def bind(self, source: Path, inside: str) -> Path:
        """Show ``source`` read-only at ``inside`` in the root; returns the path as this host sees it."""
        target = self.merged / inside.lstrip("/")
        self._mount(["--bind", "-o", "ro", str(source)], target)
        return target

    def run(self, cmd: Sequence[str], timeout: float = 300, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` in the root with a clean environment; AssertionError with its output when it fails."""
        extra = [f"{k}={v}" for k, v in (env or {}).items()]
        full = ["chroot", str(self.merged), "/usr/bin/env", "-i", f"PATH={CHROOT_PATH}", "LANG=C.UTF-8",
                "HOME=/root", *extra, *cmd]
        proc = subprocess.run(full, capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def close(self) -> None:
        for target in reversed(self._mounts):
            subprocess.run(["umount", "-R", "-l", str(target)], check=False, capture_output=True, timeout=60)
        self._mounts.clear()
        with contextlib.suppress(OSError):
            for layer in ("upper", "ovl-work"):
                shutil.rmtree(self.workdir / layer, ignore_errors=True)

    def __enter__(self) -> OverlayChroot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
