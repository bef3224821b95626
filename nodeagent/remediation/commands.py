"""The reset and reboot commands (the subprocess adapter of remediation).

The default reset is the node driver's ``nvidia-smi -r -i <UUID>[,<UUID>...]``: the GPUs of one reset group
in one command, as NVIDIA asks for NVLink peers that must be reset together. ``remediation.reset_command``
replaces it: its words are split like a shell's, ``{uuid}`` stands for the comma-joined UUIDs.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence

from nodeagent.errors import GpuBusyError, GpuLostError, NvmlError
from nodeagent.hostcommands import run_bounded

SMI_FELL_OFF_BUS = 15  # nvidia-smi's exit code for a GPU that fell off the bus


def reset_argv(uuids: Sequence[str], command: str = "", smi: str = "nvidia-smi") -> list[str]:
    joined = ",".join(uuids)
    if not command:
        return [smi, "-r", "-i", joined]
    return [w.replace("{uuid}", joined) for w in shlex.split(command)]


class CommandResetter:
    """Resets GPUs by running the reset command, bounded by ``timeout_s``."""

    def __init__(self, command: str = "", *, smi: str = "nvidia-smi", timeout_s: float = 120.0) -> None:
        self.command = command
        self.smi = smi
        self.timeout_s = timeout_s

    def reset(self, uuids: Sequence[str]) -> None:
        argv = reset_argv(uuids, self.command, self.smi)
        ran = run_bounded(argv, timeout=self.timeout_s, env=dict(os.environ), keep_tail=True)
        if ran.returncode == 0:
            return
        lines = (ran.stdout + ran.stderr).strip().splitlines()
        detail = ran.problem or (lines[-1].strip() if lines else f"exit {ran.returncode}")
        msg = f"GPU {','.join(uuids)}: {shlex.join(argv[:2])}... failed: {detail}"
        subject = uuids[0] if uuids else None
        if ran.returncode == SMI_FELL_OFF_BUS or "fallen off the bus" in detail.lower():
            raise GpuLostError(msg, subject=subject)
        if "in use" in detail.lower():
            raise GpuBusyError(msg, subject=subject)
        raise NvmlError(msg, subject=subject)


class CommandReboot:
    """Reboots the node with the configured command (only ever built when one is configured)."""

    def __init__(self, command: str, *, timeout_s: float = 60.0) -> None:
        self.argv = shlex.split(command)
        self.timeout_s = timeout_s

    async def __call__(self, reason: str) -> None:
        import asyncio

        ran = await asyncio.to_thread(run_bounded, self.argv, timeout=self.timeout_s, env=dict(os.environ))
        if ran.returncode != 0:
            raise NvmlError(f"reboot command {self.argv[0]} failed: {ran.problem or ran.stderr.strip()[-200:]}")
