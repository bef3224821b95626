"""NVLink fabric info through the C ABI: the real pynvml's nvmlDeviceGetGpuFabricInfo (v1) and
nvmlDeviceGetGpuFabricInfoV (v2, v3; another version: ARGUMENT_VERSION_MISMATCH) on the stand-in
libnvidia-ml.so.1 answer what the Python simulator answers, faults included, and ``discover`` is the same
(NOT_SUPPORTED before Hopper is compared for every machine by test_abi_discover)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.abi._abi import abi_env, discover, nodeagent, plain_env, run

READER = """
import ctypes, json, uuid
import pynvml
pynvml.nvmlInit()
out = []
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    v1 = pynvml.c_nvmlGpuFabricInfo_t()
    pynvml.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(v1))
    v3 = pynvml.c_nvmlGpuFabricInfo_v3_t()
    pynvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(v3))
    v2 = pynvml.c_nvmlGpuFabricInfo_v2_t()
    pynvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(v2))
    bad = pynvml.c_nvmlGpuFabricInfo_v2_t()
    bad.version = 0x09000024
    try:
        pynvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(bad))
        code = 0
    except pynvml.NVMLError as e:
        code = e.value
    out.append({"v1": [str(uuid.UUID(bytes=bytes(v1.clusterUuid))), v1.status, v1.cliqueId, v1.state],
                "v3": [str(uuid.UUID(bytes=bytes(v3.clusterUuid))), v3.cliqueId, v3.state, v3.healthMask,
                       v3.healthSummary],
                "v2_mask": v2.healthMask, "bad_version": code})
print(json.dumps(out))
"""


def test_fabric_info_same_through_the_c_abi(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    sim = ["--simulate", "gb200-nvl", "--sim-state", str(state)]  # the fresh state file is made here
    nodeagent("sim", "inject", "fabric", "--route-unhealthy", "--gpu", "2", "--clique", "7", *sim, env=plain_env())
    got = json.loads(run([sys.executable, "-c", READER], abi_env(state)).stdout)
    plain = discover(state, None, abi=False)
    assert discover(state, None, abi=True) == plain
    for g, seen in zip(plain["gpus"], got, strict=True):
        f = g["fabric"]
        assert seen["v1"] == [f["cluster_uuid"], 0, f["clique_id"], 3]
        assert seen["v3"] == [f["cluster_uuid"], f["clique_id"], 3, f["health_mask"], f["health_summary"]]
        assert seen["v2_mask"] == f["health_mask"] and seen["bad_version"] == 25  # ARGUMENT_VERSION_MISMATCH
    assert [g["fabric"]["clique_id"] for g in plain["gpus"]] == [1, 1, 7, 1]
    assert {g["fabric"]["health_summary"] for g in plain["gpus"]} == {2}  # UNHEALTHY: route unhealthy
