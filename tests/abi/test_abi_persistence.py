"""The driver persistence mode through the C ABI: the real pynvml's nvmlDeviceGet/SetPersistenceMode on the
stand-in libnvidia-ml.so.1 answer as the Python simulator does (NVML's return codes included), and
``nodeagent doctor`` on the real pynvml reports the GPU whose persistence mode is off."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.abi._abi import abi_env, discover, nodeagent, plain_env, run

# A child process on the real pynvml: the mode of every GPU, then set (argv: index, mode), read again; the
# NVML return codes of each step as JSON.
SETTER = """
import json, sys
import pynvml
pynvml.nvmlInit()
out = {}
hs = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
out["before"] = [pynvml.nvmlDeviceGetPersistenceMode(h) for h in hs]
try:
    pynvml.nvmlDeviceSetPersistenceMode(hs[int(sys.argv[1])], int(sys.argv[2]))
    out["set"] = 0
except pynvml.NVMLError as e:
    out["set"] = e.value
out["after"] = [pynvml.nvmlDeviceGetPersistenceMode(h) for h in hs]
pynvml.nvmlShutdown()
print(json.dumps(out))
"""


def _setter(state: Path, index: int, mode: int, **extra: str) -> dict[str, object]:
    doc: dict[str, object] = json.loads(
        run([sys.executable, "-c", SETTER, str(index), str(mode)], abi_env(state, **extra)).stdout)
    return doc


def test_persistence_mode_through_the_c_abi_and_doctor_on_it(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    state = root / "state.json"  # the simulated node's state, inside its root
    discover(state, "dgx-h100", abi=False)  # the state file of a fresh DGX H100
    done = _setter(state, 3, 0)
    assert done == {"before": [1] * 8, "set": 0, "after": [1, 1, 1, 0, 1, 1, 1, 1]}
    assert _setter(state, 3, 2)["set"] == 2  # NVML_ERROR_INVALID_ARGUMENT: neither disabled nor enabled
    unprivileged = _setter(state, 4, 0, NODEAGENT_SIM_UNPRIVILEGED="1")
    assert unprivileged["set"] == 4 and unprivileged["after"] == done["after"]  # NVML_ERROR_NO_PERMISSION
    abi = discover(state, None, abi=True)
    assert abi == discover(state, None, abi=False)
    assert [g["persistence_mode"] for g in abi["gpus"]] == [True, True, True, False, True, True, True, True]

    r = nodeagent("--root", str(root), "doctor", "--sim-state", str(state), "--no-kube", "--json",
                  env=abi_env(state), check=False)
    findings = json.loads(r.stdout)["findings"]
    off = [f for f in findings if f["area"] == "driver" and f["level"] == "warning"]
    assert [f["text"].split(":")[0] for f in off] == ["persistence mode disabled on GPU 3"], findings
    assert off[0]["fix"] == f"nodeagent --root {root} sim inject persistence enabled --sim-state {state}"
    nodeagent(*off[0]["fix"].split()[3:], env=plain_env())  # the fix as printed (without --root's sandbox)
    r = nodeagent("--root", str(root), "doctor", "--sim-state", str(state), "--no-kube", "--json",
                  env=abi_env(state), check=False)
    assert {"area": "driver", "level": "ok", "text": "persistence mode enabled on every GPU", "fix": ""} in \
        json.loads(r.stdout)["findings"]
