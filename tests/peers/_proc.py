"""Process helpers shared by the peer fixtures."""

from __future__ import annotations

import subprocess
from pathlib import Path


def stop_process(proc: subprocess.Popen[bytes] | subprocess.Popen[str], timeout: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
