"""``nodeagent run`` with plane "both": a reload that changes ``[dra] gpus`` moves GPUs between the running
planes. Real peers: the kube-apiserver (ResourceSlices, ResourceClaims, Events), the kubelet's device
manager (ListAndWatch, Allocate, PodResources) and the kubelet's DRA manager (prepare, unprepare). While a
pod holds a device-plugin GPU and a claim a DRA GPU, the free GPUs move at once, the held ones wait
withdrawn from both planes and move by themselves once released; no GPU is ever seen in the device
plugin's list and the ResourceSlices at once.

The move runs once per Kubernetes release (its kube-apiserver and the DRA harness built from its kubelet;
the device manager is that of 1.34, whose device-plugin API v1beta1 has not changed since)."""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
import urllib.parse
import uuid
from pathlib import Path

import pytest
import yaml

from nodeagent.hostpaths import HostPaths
from nodeagent.kube.client import KubeClient, connect
from nodeagent.nvmlsource import open_nvml
from tests.e2e._agent import Agent, eventually, node_root, running_agent
from tests.e2e._proxy import Outage
from tests.e2e.test_run_dra import (
    DRIVER,
    config,
    dra_node,
    reload_and_wait,
    remove_node,
    slice_devices,
    uuid_of,
)
from tests.integration._releases import release_binary, shared_release_apiserver
from tests.integration.test_dra_kubelet import CLAIMS, create_allocated_claim
from tests.peers.apiserver import KubeApiServer
from tests.peers.draharness import Pod, running_dra_harness
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers

release_server = shared_release_apiserver  # the API server of each release, shared with other modules

RESOURCE = "nvidia.com/gpu"


class Observer:
    """Polls both planes from a thread: the device plugin's devices as the kubelet's device manager lists
    them, and the GPUs in the node's ResourceSlices. A GPU counts as offered twice when it is in the slices
    between two reads of the plugin's list that both show it (so the order of the reads cannot make it up)."""

    def __init__(self, server: KubeApiServer, harness: KubeletHarness, node: str, index_of: dict[str, int]) -> None:
        self.server, self.harness, self.node, self.index_of = server, harness, node, index_of
        self.samples: list[tuple[float, set[int], set[int]]] = []  # (time, plugin GPUs, slice GPUs)
        self.twice: list[tuple[float, set[int]]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def plugin(self) -> set[int]:
        res = self.harness.resources().get(RESOURCE)
        return {self.index_of[d.id] for d in res.devices} if res is not None else set()

    def slices(self) -> set[int]:
        return {self.index_of[uuid_of(d)] for d in (slice_devices(self.server, self.node) or {}).values()}

    def _run(self) -> None:
        try:
            self._sample()
        except BaseException as e:  # the test fails naming it
            self.error = e

    def _sample(self) -> None:
        while not self._stop.is_set():
            before = self.plugin()
            in_slices = self.slices()
            after = self.plugin()
            now = time.monotonic()
            self.samples.append((now, after, in_slices))
            if before & after & in_slices:
                self.twice.append((now, before & after & in_slices))
            time.sleep(0.02)

    def __enter__(self) -> Observer:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def first(self, cond: str, gpu: int, since: float) -> float:
        """The first sample time after ``since`` where ``gpu`` is in the slices (``cond`` "dra") or the
        plugin's list ("plugin")."""
        def seen() -> float | None:
            assert self.error is None, "".join(__import__("traceback").format_exception(self.error))
            for t, plugin, dra in list(self.samples):
                if t >= since and gpu in (dra if cond == "dra" else plugin):
                    return t
            return None

        found: float = eventually(seen, 5, f"GPU {gpu} in {cond} in the observer's samples")
        return found


def gpu_indices(tmp_path: Path, root: Path) -> dict[str, int]:
    """GPU UUID -> index on the simulated node (the agent's state file in its root)."""
    gpu = open_nvml("dgx-h100", root / "sim.json", HostPaths(root))
    try:
        return {g.uuid: g.index for g in gpu.discover().gpus}
    finally:
        gpu.close()


def wait_split(obs: Observer, plugin: set[int], dra: set[int], what: str, timeout: float = 20) -> None:
    eventually(lambda: obs.plugin() == plugin and obs.slices() == dra, timeout, what)


def test_a_reload_moves_free_gpus_at_once_and_held_ones_after_their_holders(
    tmp_path: Path, release_server: KubeApiServer, kubelet_harness: KubeletHarness
) -> None:
    kube_apiserver = release_server
    dra_harness = release_binary(kube_apiserver.version, "dra-harness")
    node = "e2e-planes"
    cfg, args = dra_node(tmp_path, kube_apiserver, node, "both", "gpus = [0, 1]\n")

    def write(gpus: str) -> None:
        config(cfg, kube_apiserver, "both", f"gpus = {gpus}\n")
        cfg.write_text(cfg.read_text().replace("events = false", "events = true")
                       + '[kubelet]\npod_resources_socket = "/var/lib/kubelet/pod-resources.sock"\n')

    write("[0, 1]")
    kube = KubeClient(connect(kube_apiserver.kubeconfig))
    claims: list[str] = []
    try:
        with node_root(kubelet_harness) as root, contextlib.ExitStack() as agents:
            agent = agents.enter_context(running_agent(tmp_path, root, args))
            agent.wait_notify("READY=1", timeout=20)
            index_of = gpu_indices(tmp_path, root)
            every = set(range(8))
            obs = Observer(kube_apiserver, kubelet_harness, node, index_of)
            wait_split(obs, every - {0, 1}, {0, 1}, "GPUs 0, 1 in DRA, the others in the device plugin")

            with running_dra_harness(kube_apiserver.kubeconfig, root / "var/lib/kubelet/plugins_registry", node,
                                     binary=dra_harness, host_root=root) as dra:
                dra.wait_registered(DRIVER, timeout=20)
                # a claim holds GPU 0 on the DRA plane, a pod holds one device-plugin GPU
                claim_pod = Pod("default", "planes-claim", str(uuid.uuid4()), {}, {"main": ["gpu"]})
                create_allocated_claim(kube, node, [("gpu", "gpu-0")], claim_pod)
                claims += list(claim_pod.claims)
                assert dra.prepare(claim_pod)["main"]
                held = index_of[kubelet_harness.allocate(RESOURCE, 1, pod="planes-pod").device_ids[0]]
                free = min(every - {0, 1, held})
                # GPU 0 (held) and 1 (free) leave DRA; ``held`` and ``free`` leave the device plugin
                with obs:
                    write(f"[{held}, {free}]")
                    t0 = time.monotonic()
                    reload_and_wait(agent)
                    wait_split(obs, every - {0, held, free}, {free}, "the free GPUs moved")
                    moved_to_dra = obs.first("dra", free, t0) - t0
                    moved_to_plugin = obs.first("plugin", 1, t0) - t0
                    assert "reload: changed dra" in agent.log() and "component dra started" in agent.log()
                    assert agent.log().count("component dra started") == 1  # moved live, not rebuilt
                    eventually(lambda: agent.log().count("GpuPlaneMoveWaiting") == 2, 10, "both waits reported")
                    log = agent.log()
                    assert f"GPU {held} from the device plugin to DRA waits: held by pod default/planes-pod" in log
                    claim = f"default/{claims[0]}"
                    assert f"GPU 0 from DRA to the device plugin waits: held by claim {claim}" in log
                    time.sleep(2)  # the holders stay: nothing moves
                    assert obs.plugin() == every - {0, held, free} and obs.slices() == {free}

                    # a restart while both wait: the next process keeps them withdrawn (the ledger's file)
                    code, _ = agent.stop()
                    assert code == 0, agent.log()
                    (tmp_path / "second").mkdir()
                    agent = agents.enter_context(running_agent(tmp_path / "second", root, args))
                    agent.wait_notify("READY=1", timeout=20)
                    eventually(lambda: agent.log().count("GpuPlaneMoveWaiting") == 2, 10, "both waits reported again")
                    time.sleep(1)
                    assert obs.plugin() == every - {0, held, free} and obs.slices() == {free}

                    kubelet_harness.release("default/planes-pod")
                    t_release = time.monotonic()
                    wait_split(obs, every - {0, held, free}, {free, held}, "the released GPU moved to DRA")
                    released_moved = obs.first("dra", held, t_release) - t_release
                    dra.unprepare(claim_pod)
                    wait_split(obs, every - {held, free}, {held, free}, "the unprepared GPU moved to the plugin")
                assert not obs.twice, obs.twice
                assert len(obs.samples) > 20
            reasons = [e["reason"] for e in kube.request("GET", f"/api/v1/namespaces/default/events?fieldSelector="
                                                         f"involvedObject.name%3D{node}")["items"]]
            assert reasons.count("GpuPlaneMoved") == 4 and reasons.count("GpuPlaneMoveWaiting") == 4, reasons
            print(json.dumps({"release": kube_apiserver.version, "free_gpu_to_dra_s": round(moved_to_dra, 3),
                              "free_gpu_to_plugin_s": round(moved_to_plugin, 3),
                              "released_gpu_to_dra_s": round(released_moved, 3), "samples": len(obs.samples)}))

            # bad input on reload: one error line, nothing changes
            for bad, error in (("[1, 9]", "key 'dra.gpus' names GPU 9, which this node does not have"),
                               ("[]", "key 'dra.gpus' must list the GPU indices DRA serves")):
                write(bad)
                reload_and_wait(agent)
                line = eventually(functools.partial(rejected, agent, error), 5, f"reload of gpus = {bad} rejected")
                assert str(cfg) in line, line
            assert obs.plugin() == every - {held, free} and obs.slices() == {held, free}
            assert agent.log().count("GpuPlaneMoved") == 2  # the held GPUs, after the restart
            code, _ = agent.stop()
            assert code == 0, agent.log()
    finally:
        kube.close()
        for name in claims:
            kube_apiserver.request("DELETE", f"{CLAIMS}/{name}")
        remove_node(kube_apiserver, node)


def rejected(agent: Agent, error: str) -> str:
    """The log line of a rejected reload naming ``error`` ("" while there is none)."""
    return next((line for line in agent.log().splitlines()
                 if "reload rejected, keeping the running config: " in line and error in line), "")


def test_a_gpu_leaving_dra_waits_for_its_slices_through_an_api_outage(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness
) -> None:
    """The agent reaches the API through a forwarder that is cut before the reload: GPU 1, free, leaves DRA,
    but the slices without it cannot be written; the device plugin does not list it until they are."""
    node = "e2e-planes-outage"
    cfg, args = dra_node(tmp_path, kube_apiserver, node, "both", "gpus = [0, 1]\n")
    url = urllib.parse.urlsplit(kube_apiserver.url)
    outage = Outage((url.hostname or "127.0.0.1", url.port or 443))
    outage.restore()
    doc = yaml.safe_load(kube_apiserver.kubeconfig.read_text())
    for c in doc["clusters"]:
        c["cluster"]["server"] = f"https://{url.hostname}:{outage.port}"
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(doc))

    def write(gpus: str) -> None:
        config(cfg, kube_apiserver, "both", f"gpus = {gpus}\n")
        cfg.write_text(cfg.read_text().replace(str(kube_apiserver.kubeconfig), str(tmp_path / "kubeconfig"))
                       + '[kubelet]\npod_resources_socket = "/var/lib/kubelet/pod-resources.sock"\n')

    write("[0, 1]")
    try:
        with node_root(kubelet_harness) as root, running_agent(tmp_path, root, args) as agent:
            agent.wait_notify("READY=1", timeout=20)
            index_of = gpu_indices(tmp_path, root)
            every = set(range(8))
            obs = Observer(kube_apiserver, kubelet_harness, node, index_of)
            wait_split(obs, every - {0, 1}, {0, 1}, "GPUs 0, 1 in DRA, the others in the device plugin")
            with obs:
                outage.cut()
                write("[0]")
                reload_and_wait(agent)
                eventually(lambda: "GPU(s) 1 wait: the ResourceSlices are not written yet" in agent.log(), 10,
                           "the move waits for the slices")
                time.sleep(1.5)
                assert obs.plugin() == every - {0, 1} and obs.slices() == {0, 1}  # the API still has GPU 1
                outage.restore()
                wait_split(obs, every - {0}, {0}, "GPU 1 moved once the slices were written", timeout=40)
            assert not obs.twice, obs.twice
            assert "GpuPlaneMoved: GPU 1 from DRA to the device plugin" in agent.log()
            code, _ = agent.stop()
            assert code == 0, agent.log()
    finally:
        outage.cut()
        remove_node(kube_apiserver, node)
