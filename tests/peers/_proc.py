"""Process helpers shared by the peer fixtures."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any


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


def exchange(proc: subprocess.Popen[str], request: dict[str, Any], what: str, log_tail: Callable[[], str],
             error: Callable[[str], Exception]) -> dict[str, Any]:
    """One command to a peer that answers JSON lines on stdin/stdout: the decoded answer (the caller checks
    its ``ok``). Raises ``error`` with the peer's log tail when it is not running or dies before answering.
    The caller serialises calls (one request, one answer line)."""
    if proc.poll() is not None or proc.stdin is None or proc.stdout is None:
        raise error(f"{what} is not running:\n{log_tail()}")
    proc.stdin.write(json.dumps(request) + "\n")
    proc.stdin.flush()
    answer = proc.stdout.readline()
    if not answer:
        raise error(f"{what} died during {request['cmd']!r}:\n{log_tail()}")
    reply: dict[str, Any] = json.loads(answer)
    return reply


def quit_peer(proc: subprocess.Popen[str]) -> None:
    """Ask a JSON-lines peer to quit, stop it if it lingers, and close its pipes."""
    if proc.poll() is None and proc.stdin is not None:
        try:
            proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            proc.stdin.flush()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
    stop_process(proc)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()
