"""dcgm-exporter's fields from a running agent: the values a scrape shows are the simulator's, the output lints
clean with promtool but for dcgm-exporter's own camelCase label, and every query of NVIDIA's dcgm-exporter
dashboard (grafana.com 12239) that docs/metrics.md lists as filled returns data on the scraped series.

The agent runs on a simulated DGX H100 (Hopper: GPM is there) without Kubernetes: GPU 0 in MIG mode with a
3g.40gb and a 1g.10gb instance and a process in the 1g.10gb one, a process on GPU 1, the others idle."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from nodeagent.gpu.nvml import NvmlAdapter
from nodeagent.simulator.open import open_sim
from tests._metrics import scrape_or_none
from tests.e2e._agent import eventually, node_root, running_agent
from tests.e2e.test_prometheus_rules import _get, check_metrics, input_series, parse
from tests.peers._resolve import system_binary
from tests.peers.apiserver import free_port
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers

MACHINE = "dgx-h100"

# The queries of dcgm-exporter's dashboard (grafana/dcgm-exporter-dashboard.json), by panel, with its
# template variables $Hostname and $gpu set to "all".
DASHBOARD_QUERIES = {
    "GPU Temperature": 'max(DCGM_FI_DEV_GPU_TEMP{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, uuid)',
    "GPU Avg. Temp": 'avg(DCGM_FI_DEV_GPU_TEMP{Hostname=~"$Hostname", gpu=~"$gpu"})',
    "GPU Power Usage": 'max(DCGM_FI_DEV_POWER_USAGE{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, uuid)',
    "GPU Power Total": 'sum(max(DCGM_FI_DEV_POWER_USAGE{Hostname=~"$Hostname", gpu=~"$gpu"}) by (gpu))',
    "GPU SM Clocks": 'max(DCGM_FI_DEV_SM_CLOCK{Hostname=~"$Hostname", gpu=~"$gpu"} * 1000000) by (Hostname, UUID, gpu)',
    "GPU Utilization": 'max(DCGM_FI_PROF_GR_ENGINE_ACTIVE{Hostname=~"$Hostname", gpu=~"$gpu"}) '
                       "by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)",
    "Tensor Core Utilization": 'max(DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{Hostname=~"$Hostname", gpu=~"$gpu"}) '
                               "by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)",
    "GPU Framebuffer Mem Used": 'max(DCGM_FI_DEV_FB_USED{Hostname=~"$Hostname", gpu=~"$gpu"}) '
                                "by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)",
    # the template variables' queries, label_values(DCGM_FI_DEV_FB_FREE, Hostname) and (..., gpu)
    "variable Hostname": "count(DCGM_FI_DEV_FB_FREE) by (Hostname)",
    "variable gpu": 'count(DCGM_FI_DEV_FB_FREE{Hostname=~"$Hostname"}) by (gpu)',
}


@pytest.fixture(scope="module")
def promtool() -> Path:
    exported = os.environ.get("NODEAGENT_PROMTOOL")
    return Path(exported) if exported else system_binary("promtool", "prometheus")


def _sim(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "nodeagent", "sim", *args], capture_output=True, text=True,
                       timeout=30, check=False)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def agent_scrape(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, float]:
    """(/metrics of the running agent once GPM shows the busy GPU and GPU instance, the sim state, when)."""
    from nodeagent.simulator.inject import inject_process
    from nodeagent.simulator.state import SimStore

    work = tmp_path_factory.mktemp("dcgm")
    state = work / "sim.json"
    cfg = work / "config.toml"
    cfg.write_text("resync_interval = 300.0\n[runtime]\ncheck_interval = 0.0\n[metrics]\ninterval = 1.0\n")
    _sim("mig", "--simulate", MACHINE, "--sim-state", str(state), "--gpu", "0", "3g.40gb", "1g.10gb")
    store = SimStore.open(None, state)
    small = max(gi["id"] for gi in store.read()["gpus"][0]["gis"] if gi["size"] == 1)
    inject_process(store, 0, 4100, "infer", 3000, gi_id=small)
    inject_process(store, 1, 4200, "train", 20000)
    port = free_port()
    with node_root() as root:
        shutil.copyfile(state, root / "sim.json")  # the simulated node's state lies inside its root
        args = ["run", "--config", str(cfg), "--simulate", MACHINE, "--sim-state", str(root / "sim.json"),
                "--no-kube"]
        with running_agent(work, root, args, metrics=f"127.0.0.1:{port}") as agent:
            text = _busy_scrape(port)
            when = time.monotonic()
            assert "Traceback" not in agent.log()
        shutil.copyfile(root / "sim.json", state)  # as the agent left it, for the tests
    return text, state, when


def _busy_scrape(port: int) -> str:
    """The scrape once GPM shows the busy GPU."""

    def busy_gpm() -> str | None:
        text = _get(port, "DCGM_FI_PROF_GR_ENGINE_ACTIVE{")
        return text if text and _series(text, "DCGM_FI_PROF_GR_ENGINE_ACTIVE").get(("1", ""), 0) > 0 else None

    found: str = eventually(busy_gpm, 30, "GPM of the busy GPU in the scrape")
    return found


def _series(text: str, name: str) -> dict[tuple[str, str], float]:
    return {(s.labels["gpu"], s.labels["GPU_I_ID"]): s.value for s in parse(text) if s.name == name}


def test_scraped_values_are_the_simulators(agent_scrape: tuple[str, Path, float]) -> None:
    text, state, when = agent_scrape
    nvml = NvmlAdapter(open_sim(MACHINE, state))
    try:
        inv = nvml.discover()
        readings = {g.index: nvml.metrics(g.index) for g in inv.gpus}
    finally:
        nvml.close()
    labels = {s.labels["gpu"]: s.labels for s in parse(text) if s.name == "DCGM_FI_DEV_GPU_TEMP"}
    for g in inv.gpus:  # identity labels, as dcgm-exporter names them
        lab = labels[str(g.index)]
        assert (lab["UUID"], lab["pci_bus_id"], lab["modelName"], lab["device"]) == (
            g.uuid, g.pci_bus_id, g.name, f"nvidia{g.minor_number}")
        assert lab["Hostname"] and lab["GPU_I_ID"] == ""
    temp, mem_temp = _series(text, "DCGM_FI_DEV_GPU_TEMP"), _series(text, "DCGM_FI_DEV_MEMORY_TEMP")
    power, energy = _series(text, "DCGM_FI_DEV_POWER_USAGE"), _series(text, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION")
    sm, mem = _series(text, "DCGM_FI_DEV_SM_CLOCK"), _series(text, "DCGM_FI_DEV_MEM_CLOCK")
    used, free = _series(text, "DCGM_FI_DEV_FB_USED"), _series(text, "DCGM_FI_DEV_FB_FREE")
    util, gr = _series(text, "DCGM_FI_DEV_GPU_UTIL"), _series(text, "DCGM_FI_PROF_GR_ENGINE_ACTIVE")
    for i in range(2, 8):  # idle GPUs: the simulator's figures exactly (energy: the idle draw over the uptime)
        r, k = readings[i], (str(i), "")
        assert (temp[k], mem_temp[k], power[k], sm[k], mem[k]) == (
            r.temperature_c, r.memory_temperature_c, r.power_w, r.sm_clock_mhz, r.mem_clock_mhz)
        assert (used[k], free[k], util[k], gr[k]) == (r.memory_used_mib, r.memory_free_mib, 0, 0)
        assert r.energy_mj is not None and 0 < r.energy_mj - energy[k] < 72_000 * (time.monotonic() - when + 5)
    busy = readings[1]  # the load wave moves between the agent's reading and the test's: within its range
    assert busy.utilisation_pct is not None and 40 <= util[("1", "")] <= 95
    assert 0.38 <= gr[("1", "")] <= 0.96 and 1800 <= sm[("1", "")] <= 1980 and mem[("1", "")] == 2619
    assert power[("1", "")] > 250 and used[("1", "")] == busy.memory_used_mib == 20005
    # GPU 0 in MIG mode: no whole-GPU utilisation or GPM; per GPU instance its memory and GPM
    assert ("0", "") not in util and ("0", "") not in gr
    mig = {str(m.gi_id): m for m in readings[0].mig}
    profiles = {s.labels["GPU_I_ID"]: s.labels["GPU_I_PROFILE"] for s in parse(text)
                if s.name == "DCGM_FI_DEV_FB_USED" and s.labels["gpu"] == "0" and s.labels["GPU_I_ID"]}
    assert sorted(profiles.values()) == ["1g.10gb", "3g.40gb"]
    for gi, m in mig.items():
        assert (used[("0", gi)], free[("0", gi)]) == (m.memory_used_mib, m.memory_free_mib)
    small = next(gi for gi, p in profiles.items() if p == "1g.10gb")
    big = next(gi for gi, p in profiles.items() if p == "3g.40gb")
    assert used[("0", small)] == 3000 and 0.2 <= gr[("0", small)] <= 0.96 and gr[("0", big)] == 0


def test_promtool_check_metrics_finds_only_dcgm_exporters_camel_case_label(
        promtool: Path, agent_scrape: tuple[str, Path, float]) -> None:
    import re

    text = agent_scrape[0]
    proc = check_metrics(promtool, text)
    for line in (proc.stdout + proc.stderr).strip().splitlines():
        assert re.fullmatch(r"DCGM_FI_\w+ label names should be written in 'snake_case' not 'camelCase'", line), line
    proc = check_metrics(promtool, text.replace("modelName=", "model_name="))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dcgm_exporter_dashboard_queries_return_data(
        promtool: Path, agent_scrape: tuple[str, Path, float], tmp_path: Path) -> None:
    queries = {title: q.replace("$Hostname", ".*").replace("$gpu", ".*") for title, q in DASHBOARD_QUERIES.items()}
    tests = [{"expr": f"(count({q}) > bool 0) or vector(0)", "eval_time": "15m",
              "exp_samples": [{"labels": "{}", "value": 1}]} for q in queries.values()]
    spec = {"rule_files": [], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": input_series(agent_scrape[0]), "promql_expr_test": tests}]}
    test_file = tmp_path / "dcgm-dashboard-test.yaml"
    test_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    proc = subprocess.run([str(promtool), "test", "rules", str(test_file)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, "\n".join(
        [proc.stdout + proc.stderr] + [f"{title}: {q}" for title, q in queries.items() if q in proc.stdout])


def test_pods_holding_a_gpu_and_a_mig_device_label_their_own_series(
        tmp_path: Path, kubelet_harness: KubeletHarness) -> None:
    """PodResources (the kubelet's device manager, served by the harness): a pod holding a 1g.10gb MIG device
    labels that GPU instance's series, a pod holding a whole GPU labels that GPU's; nothing else."""
    port = free_port()
    with node_root(kubelet_harness) as root:
        state = root / "sim.json"  # the simulated node's state lies inside its root
        _sim("mig", "--simulate", MACHINE, "--sim-state", str(state), "--gpu", "0", "3g.40gb", "1g.10gb")
        etc = root / "etc/nodeagent"
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "dp.yaml").write_text("version: v1\nflags:\n  migStrategy: mixed\n")
        cfg = etc / "config.toml"
        cfg.write_text('resync_interval = 1.0\n[device_plugin]\nconfig = "/etc/nodeagent/dp.yaml"\n'
                       "[mig]\nenabled = false\n[runtime]\nenabled = false\n[metrics]\ninterval = 1.0\n"
                       '[kubelet]\npod_resources_socket = "/var/lib/kubelet/pod-resources.sock"\n')
        args = ["run", "--config", str(cfg), "--simulate", MACHINE, "--sim-state", str(state), "--no-kube"]
        with running_agent(tmp_path, root, args, metrics=f"127.0.0.1:{port}") as agent:
            kubelet_harness.wait("nvidia.com/mig-1g.10gb", registered=True, total=1, timeout=30)
            kubelet_harness.wait("nvidia.com/gpu", registered=True, total=7, timeout=30)
            mig = kubelet_harness.allocate("nvidia.com/mig-1g.10gb", 1, pod="infer", namespace="ml", container="srv")
            gpu = kubelet_harness.allocate("nvidia.com/gpu", 1, pod="train", namespace="ml", container="main")

            def held() -> list[dict[str, str]]:
                fams = scrape_or_none(port) or {}
                return [lab for lab, _ in fams.get("DCGM_FI_DEV_FB_USED", []) if lab.get("pod")]

            eventually(lambda: len(held()) == 2, 30, "both holders on the metrics")
            by_pod = {lab["pod"]: lab for lab in held()}
            infer, train = by_pod["infer"], by_pod["train"]
            assert (infer["gpu"], infer["GPU_I_PROFILE"], infer["namespace"], infer["container"]) == (
                "0", "1g.10gb", "ml", "srv")
            assert train["GPU_I_ID"] == "" and train["UUID"] == gpu.device_ids[0]
            (mig_uuid,) = mig.device_ids
            with NvmlAdapter(open_sim(MACHINE, state)) as nvml:
                (held_gi,) = [d.gi_id for d in nvml.discover().gpus[0].mig_devices if d.uuid == mig_uuid]
            assert infer["GPU_I_ID"] == str(held_gi)
            assert "Traceback" not in agent.log()
