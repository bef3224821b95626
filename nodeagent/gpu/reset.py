"""Resetting a GPU on a host: ``nvidia-smi --gpu-reset -i N`` (the ``GpuResetter`` of real nodes)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from nodeagent.errors import GpuBusyError, NvmlError, ResetRequiredError


class NvidiaSmiResetter:
    """Resets one GPU with nvidia-smi. ``label``/``subject`` name a GPU index in messages and errors."""

    def __init__(self, label: Callable[[int], str] = lambda i: f"GPU {i}",
                 subject: Callable[[int], str] = str, timeout_s: float = 120.0) -> None:
        self.label = label
        self.subject = subject
        self.timeout_s = timeout_s

    def reset_gpu(self, index: int) -> None:
        try:
            proc = subprocess.run(
                ["nvidia-smi", "--gpu-reset", "-i", str(index)],
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NvmlError(f"{self.label(index)}: nvidia-smi --gpu-reset failed: {e}",
                            subject=self.subject(index)) from e
        if proc.returncode == 0:
            return
        out = (proc.stdout + proc.stderr).strip().splitlines()
        detail = out[-1] if out else f"exit {proc.returncode}"
        low = detail.lower()
        msg = f"{self.label(index)}: GPU reset failed: {detail}"
        if "in use" in low:
            raise GpuBusyError(msg, subject=self.subject(index))
        if "not supported" in low or "reboot" in low:  # e.g. inside a VM: only a reboot applies the change
            raise ResetRequiredError(msg + "; reboot the host to apply the change", subject=self.subject(index))
        raise NvmlError(msg, subject=self.subject(index))
