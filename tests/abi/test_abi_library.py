"""The stand-in library itself: every nvml.h function is exported, unserved ones answer NOT_SUPPORTED,
bad input gets NVML's error codes, and nothing crashes the caller. Each case runs in a child process (C
calls through ctypes there, the way any non-pynvml caller would)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.abi._abi import abi_env, discover, library, run

PROBE = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
c = ctypes.c_uint(0)
h = ctypes.c_void_p(0)
buf = ctypes.create_string_buffer(96)
out = {}
out["before_init"] = lib.nvmlDeviceGetCount_v2(ctypes.byref(c))
out["init"] = lib.nvmlInit_v2()
out["count"] = lib.nvmlDeviceGetCount_v2(ctypes.byref(c)), c.value
out["unserved"] = lib.nvmlDeviceGetFanSpeed(h, ctypes.byref(c))
out["unserved_again"] = lib.nvmlDeviceGetPowerState(h, ctypes.byref(c))
out["bad_index"] = lib.nvmlDeviceGetHandleByIndex_v2(99, ctypes.byref(h))
out["null_out"] = lib.nvmlDeviceGetCount_v2(None)
out["null_handle"] = lib.nvmlDeviceGetName(None, buf, 96)
out["bad_handle"] = lib.nvmlDeviceGetName(ctypes.c_void_p(12345), buf, 96)
lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h))
out["small_buffer"] = lib.nvmlDeviceGetName(h, buf, 4)
out["name"] = lib.nvmlDeviceGetName(h, buf, 96), buf.value.decode()
lib.nvmlErrorString.restype = ctypes.c_char_p
out["error_string"] = lib.nvmlErrorString(3).decode()
out["shutdown"] = lib.nvmlShutdown()
out["after_shutdown"] = lib.nvmlDeviceGetCount_v2(ctypes.byref(c))
print(repr(out))
"""


def _go_env() -> dict[str, str]:
    return {**os.environ, "GOFLAGS": "-mod=mod"}


def test_every_nvml_h_function_is_exported(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["go", "list", "-m", "-f", "{{.Dir}}", "github.com/NVIDIA/go-nvml"], env=_go_env(), capture_output=True,
        text=True, check=True, cwd=Path(__file__).resolve().parents[1] / "testbin" / "nvml-view",
    )  # fmt: skip
    header = (Path(proc.stdout.strip()) / "pkg" / "nvml" / "nvml.h").read_text()
    declared = set(re.findall(r"nvmlReturn_t\s+DECLDIR\s+(\w+)\s*\(", header)) | {"nvmlErrorString"}
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", str(library())], capture_output=True, text=True, check=True
    )
    exported = {line.split()[-1] for line in symbols.stdout.splitlines() if " T " in line}
    assert len(declared) > 400
    assert declared - exported == set()


def test_c_callers_get_nvml_codes_and_never_crash(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    discover(state, "t4x1", abi=False)
    proc = run([sys.executable, "-c", PROBE, str(library())], abi_env(state))
    out = eval(proc.stdout)  # a dict literal printed by the probe
    assert out == {
        "before_init": 1,  # UNINITIALIZED
        "init": 0,
        "count": (0, 1),
        "unserved": 3,  # NOT_SUPPORTED
        "unserved_again": 3,
        "bad_index": 2,  # INVALID_ARGUMENT
        "null_out": 2,
        "null_handle": 2,
        "bad_handle": 2,
        "small_buffer": 7,  # INSUFFICIENT_SIZE
        "name": (0, "Tesla T4"),
        "error_string": "Not Supported",
        "shutdown": 0,
        "after_shutdown": 1,
    }


def test_no_machine_configured_is_driver_not_loaded_with_one_line(tmp_path: Path) -> None:
    env = abi_env(tmp_path / "missing.json")
    env.pop("NODEAGENT_SIM_STATE")
    probe = "import ctypes, sys; print(ctypes.CDLL(sys.argv[1]).nvmlInit_v2())"
    proc = run([sys.executable, "-c", probe, str(library())], env)
    assert proc.stdout.strip() == "9"  # NVML_ERROR_DRIVER_NOT_LOADED
    assert "NODEAGENT_SIM_MACHINE" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_bad_machine_name_is_one_clear_line(tmp_path: Path) -> None:
    env = abi_env(tmp_path / "state.json", "no-such-machine")
    probe = "import ctypes, sys; print(ctypes.CDLL(sys.argv[1]).nvmlInit_v2())"
    proc = run([sys.executable, "-c", probe, str(library())], env)
    assert proc.stdout.strip() == "9"
    assert "no-such-machine" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "state.json").exists()
