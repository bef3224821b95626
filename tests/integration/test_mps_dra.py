"""MPS on the DRA plane: a claim whose opaque config asks for MPS, prepared and unprepared by the kubelet's own
DRA code (tests/testbin/dra-harness) against the real kube-apiserver; the allocation (results and config) is
written as the scheduler would."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from nodeagent.dra import DRIVER_NAME
from nodeagent.dra.component import DraComponent
from nodeagent.dra.mps import ClaimMps
from nodeagent.gpu.mps import MpsManager
from nodeagent.hostpaths import HostPaths
from nodeagent.kube.client import KubeClient
from nodeagent.simulator.mps_control import install
from tests.integration.test_dra_kubelet import CLAIMS, poll, root  # noqa: F401  (root is a fixture)
from tests.peers.apiserver import KubeApiServer
from tests.peers.draharness import DraHarnessError, Pod, running_dra_harness
from tests.unit._dp_inventories import mig_box

pytestmark = pytest.mark.peers

MPS_PARAMS = {
    "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
    "sharing": {"strategy": "MPS", "mpsConfig": {
        "defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi",
        "defaultPerDevicePinnedMemoryLimit": {"1": "4Gi"}}},
}


def allocated_claim(kube: KubeClient, node: str, devices: list[str], pod: Pod, params: dict[str, Any]) -> str:
    name = f"mps-{uuid.uuid4().hex[:8]}"
    created = kube.request("POST", CLAIMS, body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu.nodeagent.io",
                                                                        "count": len(devices)}}]}},
    })
    created["status"] = {
        "allocation": {"devices": {
            "results": [{"request": "gpus", "driver": DRIVER_NAME, "pool": node, "device": d} for d in devices],
            "config": [{"source": "FromClaim", "requests": ["gpus"],
                        "opaque": {"driver": DRIVER_NAME, "parameters": params}}],
        }},
        "reservedFor": [{"resource": "pods", "name": pod.name, "uid": pod.uid}],
    }
    kube.request("PUT", f"{CLAIMS}/{name}/status", body=created)
    pod.claims[name] = name
    for claims in pod.containers.values():
        claims[:] = [name if c == "gpu" else c for c in claims]
    return str(created["metadata"]["uid"])


class _Modes(dict[str, int]):
    """The GPUs' compute modes (UUID → nvmlComputeMode_t), as the manager's NVML port sees them."""

    def compute_mode(self, uuid: str) -> int:
        return self[uuid]

    def set_compute_mode(self, uuid: str, mode: int) -> None:
        self[uuid] = mode


def control(binary: Path, pipe: Path, *commands: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binary)], input="".join(c + "\n" for c in commands), capture_output=True, text=True,
                          env={"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "PATH": "/usr/bin:/bin"}, timeout=20, check=False)


async def test_claim_with_mps_config_prepared_and_unprepared(
    kube_apiserver: KubeApiServer, kube: KubeClient, node_name: str, root: Path  # noqa: F811
) -> None:
    inv = mig_box(per_gpu=2, gpus_on=1, gpus_off=2)  # gpu-1 and gpu-2 are whole GPUs, gpu-0 has MIG devices
    paths = HostPaths(root)
    binary = install(paths("/usr/bin/nvidia-cuda-mps-control"))

    modes = _Modes({g.uuid: 0 for g in inv.gpus})  # every GPU in compute mode DEFAULT
    shared = [inv.gpus[1].uuid, inv.gpus[2].uuid]

    def component() -> DraComponent:
        manager = MpsManager(binary, compute_modes=modes, record=paths("/run/nodeagent/mps/exclusive-gpus-dra.json"))
        return DraComponent(paths=paths, kube=kube, node_name=node_name, verify_interval_s=0.5,
                            mps=ClaimMps(manager, paths))

    dra = component()
    await dra.start(inv)
    started = [dra]
    try:
        with running_dra_harness(kube_apiserver.kubeconfig, root / "var/lib/kubelet/plugins_registry",
                                 node_name) as h:
            await asyncio.to_thread(h.wait_registered, DRIVER_NAME)
            pod = Pod("default", "infer", str(uuid.uuid4()), {}, {"main": ["gpu"]})
            uid = await asyncio.to_thread(allocated_claim, kube, node_name, ["gpu-1", "gpu-2"], pod, MPS_PARAMS)
            cdi = await asyncio.to_thread(h.prepare, pod)
            assert sorted(cdi["main"]) == [f"gpu.nodeagent.io/claim={uid}-gpu-1", f"gpu.nodeagent.io/claim={uid}-gpu-2",
                                           f"gpu.nodeagent.io/metadata={uid}_gpus"]
            spec_path = root / f"var/run/cdi/gpu.nodeagent.io-claim_{uid}.json"
            spec = json.loads(spec_path.read_text())
            pipe = f"/run/nodeagent/mps/claim-{uid}/pipe"
            edits = spec["containerEdits"]
            assert f"CUDA_MPS_PIPE_DIRECTORY={pipe}" in edits["env"]
            assert {m["containerPath"]: m["hostPath"] for m in edits["mounts"]} == {
                pipe: str(paths(pipe)), "/dev/shm": str(paths("/dev/shm"))}
            got = control(binary, paths(pipe), "get_default_active_thread_percentage",
                          "get_default_device_pinned_mem_limit 0", "get_default_device_pinned_mem_limit 1")
            assert got.stdout.split() == ["50.0", "10240M", "4096M"], got.stderr
            first = dra.mps.manager.states()[0].pid if dra.mps else None
            assert first is not None
            assert [modes[u] for u in shared] == [3, 3] and modes[inv.gpus[0].uuid] == 0  # EXCLUSIVE_PROCESS

            # the agent restarts: the daemon ends with it and comes back for the claim still prepared
            await dra.stop(withdraw_slices=False)
            assert control(binary, paths(pipe), "get_server_list").returncode == 1
            dra = component()
            started.append(dra)
            await dra.start(inv)
            assert dra.mps is not None and dra.mps.manager.ready(f"claim {uid}")
            assert json.loads(spec_path.read_text()) == spec  # the spec kept its MPS edits
            assert control(binary, paths(pipe), "get_default_active_thread_percentage").stdout.split() == ["50.0"]
            await asyncio.to_thread(h.wait_registered, DRIVER_NAME)

            def unprepare() -> bool:
                try:
                    h.unprepare(pod)
                except DraHarnessError as e:
                    assert "Unavailable" in str(e) or "is not registered" in str(e), e
                    return False
                return True

            await poll(unprepare)
            assert not spec_path.exists()
            assert set(modes.values()) == {0}  # DEFAULT again once no claim daemon serves them
            assert dra.mps.manager.states() == []
            assert control(binary, paths(pipe), "get_server_list").returncode == 1

            # refusals, one line each, nothing prepared
            bad = Pod("default", "bad", str(uuid.uuid4()), {}, {"main": ["gpu"]})
            params = json.loads(json.dumps(MPS_PARAMS))
            params["sharing"]["mpsConfig"]["defaultActiveThreadPercentage"] = 150
            await asyncio.to_thread(allocated_claim, kube, node_name, ["gpu-2"], bad, params)
            with pytest.raises(DraHarnessError, match=r"defaultActiveThreadPercentage must be an integer 1\.\.100"):
                await asyncio.to_thread(h.prepare, bad)
            mig = Pod("default", "mig", str(uuid.uuid4()), {}, {"main": ["gpu"]})
            await asyncio.to_thread(allocated_claim, kube, node_name, ["gpu-0-mig-1-0"], mig, MPS_PARAMS)
            with pytest.raises(DraHarnessError, match="gpu-0-mig-1-0 is a MIG device; MPS shares whole GPUs only"):
                await asyncio.to_thread(h.prepare, mig)
            assert dra.mps.manager.states() == []
    finally:
        for d in started:
            await d.stop()
