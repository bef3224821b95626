"""Benchmark: the whole `nodeagent run` process on a simulated dgx-h100 with mixed MIG (7 x 1g.10gb per GPU)
and 4 time-slicing replicas, against the real kubelet device manager (harness) and, unless --no-kube, the
real kube-apiserver.

Figures:
  start_to_register_s   process start -> first Register accepted by the kubelet harness
  start_to_ready_s      process start -> READY=1 on NOTIFY_SOCKET
  idle_rss_mib          resident memory at the end of the idle window (plus peak RSS seen)
  idle_cpu_pct          CPU used over the idle window, % of one core
  mig_change_s          label nvidia.com/mig.config change -> state label "success" (with the apiserver)
  kubelet_restarts      N kubelet restarts -> each re-registered; fds/threads before and after
Prints figures and one JSON line. No timing asserts. Usage:
    .venv/bin/python tests/bench/bench_daemon.py [--idle SECONDS] [--restarts 100] [--no-kube] [--abi]
    .venv/bin/python tests/bench/bench_daemon.py --idle-hour SECONDS
With --abi the agent runs on the real pynvml over the stand-in libnvidia-ml.so.1 (after
`source tests/testbin/setup.sh`; ``nvml_library_mapped`` shows the agent process has it loaded), and the
ABI overhead per NVML call and the discovery time of dgx-h100 with 56 MIG devices are printed as well.

``--idle-hour W`` measures only this: the writes a running daemon sends over an idle hour, accelerated. The
daemon (plane "both": GPUs 0-3 as DRA ResourceSlices, 4-7 through the kubelet device plugin; labels,
resources, GPU objects, Node conditions, containerd check, health polls, metrics) runs with every periodic
interval divided by 3600/W, so the resync passes, ResourceSlice verifications, containerd checks, health
polls and metrics refreshes of one hour at the default intervals all run within W seconds. The apiserver's
audit log counts every write; the target is 0 Node status writes and 0 ResourceSlice writes (0 writes at all).
The idle window defaults to the 300 s the target is stated for; ``--idle 60`` for a quick run.
The agent runs under a throw-away ``--root`` (its state never lands in the host's /var/lib/nodeagent).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psutil

from nodeagent.config import AgentConfig
from tests._metrics import scrape
from tests.e2e._agent import fresh_node_with_gpu_crd, node_root, running_agent
from tests.e2e.test_run import restart_and_wait_registration
from tests.e2e.test_run_cluster import eventually, make_node, node_obj, set_label
from tests.e2e.test_run_conditions import wire_containerd
from tests.peers._ports import free_port
from tests.peers.apiserver import KubeApiServer, start_apiserver
from tests.peers.harness import running_harness

DP_CONFIG = """version: v1
flags:
  migStrategy: mixed
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/mig-1g.10gb
      replicas: 4
"""

IDLE_WINDOW_S = 300.0


HOUR_S = 3600.0


def api_requests(port: int) -> dict[str, float]:
    """The agent's ``nodeagent_kube_api_requests_total`` by HTTP method."""
    return {lab["method"]: v for lab, v in scrape(port).get("nodeagent_kube_api_requests_total", [])}


def hour_intervals(window: float) -> dict[str, float]:
    """The default periodic intervals, each divided by 3600/window (an hour's cycles in ``window`` s)."""
    d = AgentConfig()
    scale = HOUR_S / window
    return {
        "resync_interval": d.resync_interval / scale,
        "dra.verify_interval": d.dra.verify_interval / scale,
        "runtime.check_interval": d.runtime.check_interval / scale,
        "health.poll_interval": d.health.poll_interval / scale,
        "metrics.interval": d.metrics.interval / scale,
    }


def idle_hour(window: float) -> dict[str, Any]:
    """An accelerated idle hour of a running daemon, its writes counted by the apiserver's audit log."""
    iv = hour_intervals(window)
    defaults = {k: v * HOUR_S / window for k, v in iv.items()}
    work = Path(tempfile.mkdtemp(prefix="bench-idle-hour-"))
    node = "bench-idle-hour"
    server: KubeApiServer = start_apiserver()
    figures: dict[str, Any] = {"machine": "dgx-h100", "plane": "both (DRA GPUs 0-3, device plugin 4-7)",
                               "window_s": window, "speed_up": round(HOUR_S / window, 1),
                               "cycles_per_hour": {k: round(HOUR_S / v) for k, v in defaults.items()},
                               "intervals_s": {k: round(v, 3) for k, v in iv.items()}}
    try:
        fresh_node_with_gpu_crd(server, node)
        cfg = work / "config.toml"
        cfg.write_text(
            f'kubeconfig = "{server.kubeconfig}"\nnode_name = "{node}"\nresync_interval = {iv["resync_interval"]}\n'
            f'[device_plugin]\nplane = "both"\n[dra]\ngpus = [0, 1, 2, 3]\n'
            f'verify_interval = {iv["dra.verify_interval"]}\n'
            f'[runtime]\nenabled = true\ncheck_interval = {iv["runtime.check_interval"]}\n'
            f'[health]\npoll_interval = {iv["health.poll_interval"]}\n'
            f'[metrics]\ninterval = {iv["metrics.interval"]}\n'
            '[kubelet]\npod_resources_socket = "/var/lib/kubelet/pod-resources.sock"\n')
        with running_harness() as harness, node_root(harness) as root:
            wire_containerd(root)
            args = ["run", "--config", str(cfg), "--simulate", "dgx-h100", "--sim-state", str(root / "sim.json")]
            _, offset = server.audit_writes()
            port = free_port()
            with running_agent(work, root, args, metrics=f"127.0.0.1:{port}") as agent:
                agent.wait_notify("READY=1", timeout=60)
                eventually(lambda: server.get(
                    f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3D{node}")[1].count(
                    b'"gpu-') >= 4, 30, "ResourceSlices")
                time.sleep(5.0)  # the start-up writes land before the window opens
                start, offset = server.audit_writes(offset)
                figures["start_writes"] = len([w for w in start if w.user != "system:apiserver"])
                req0 = api_requests(port)
                t0 = time.monotonic()
                time.sleep(window)
                elapsed = time.monotonic() - t0
                idle, offset = server.audit_writes(offset)
                req1 = api_requests(port)
                code, _ = agent.stop()
                log = agent.log()
        mine = [w for w in idle if w.user != "system:apiserver"]
        by: dict[str, int] = {}
        for w in mine:
            key = f"{w.verb} {w.resource}{'/' + w.subresource if w.subresource else ''}"
            by[key] = by.get(key, 0) + 1
        figures["idle_window_s"] = round(elapsed, 1)
        figures["idle_writes"] = len(mine)
        figures["idle_node_status_writes"] = sum(w.resource == "nodes" and w.subresource == "status" for w in mine)
        figures["idle_resourceslice_writes"] = sum(w.resource == "resourceslices" for w in mine)
        figures["idle_writes_by_kind"] = by
        # the cycles did run: the agent's own count of the (read) requests it sent in the window
        figures["idle_api_requests_by_method"] = {m: int(req1.get(m, 0) - req0.get(m, 0)) for m in sorted(req1)
                                                  if req1.get(m, 0) != req0.get(m, 0)}
        figures["agent_log_errors"] = sum("Traceback" in line or " ERROR " in line for line in log.splitlines())
        figures["sigterm_exit"] = code
    finally:
        server.stop()
    return figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle", type=float, default=IDLE_WINDOW_S,
                    help=f"idle window in seconds (default {IDLE_WINDOW_S:.0f}, the window the target is stated for)")
    ap.add_argument("--restarts", type=int, default=100)
    ap.add_argument("--no-kube", action="store_true")
    ap.add_argument("--idle-hour", type=float, default=0.0, metavar="SECONDS",
                    help="only measure the writes of an idle hour, accelerated into SECONDS")
    ap.add_argument("--abi", action="store_true", help="the agent on the real pynvml over the stand-in library")
    opts = ap.parse_args()
    if opts.idle_hour > 0:
        hour = idle_hour(opts.idle_hour)
        print(f"idle hour accelerated {hour['speed_up']}x: every default interval divided by {hour['speed_up']} "
              f"so one hour of cycles runs in {hour['window_s']:.0f} s")
        for k, v in hour["intervals_s"].items():
            print(f"  {k:24} {v:8.3f} s  ({hour['cycles_per_hour'][k]} cycles = one hour at the default)")
        print(f"writes at start-up (before the window): {hour['start_writes']}")
        print(f"idle hour: {hour['idle_writes']} writes ({hour['idle_node_status_writes']} Node status, "
              f"{hour['idle_resourceslice_writes']} ResourceSlice) over {hour['idle_window_s']} s; "
              f"by kind: {hour['idle_writes_by_kind'] or 'none'}")
        print(f"requests the agent sent in the window (reads: the cycles ran): {hour['idle_api_requests_by_method']}")
        print(json.dumps({"bench": "daemon-idle-hour", **hour}))
        return
    abi: dict[str, Any] = {}
    if opts.abi:
        from tests.bench.bench_abi import abi_environment, abi_figures

        os.environ.update(abi_environment())  # the agent inherits it
        abi = abi_figures(with_go=False)
    work = Path(tempfile.mkdtemp(prefix="bench-daemon-"))
    sim = work / "sim.json"
    # the mixed MIG layout, written as if applied earlier: 7 x 1g.10gb on each of the 8 GPUs
    import subprocess

    subprocess.run([sys.executable, "-m", "nodeagent", "sim", "mig", "--simulate", "dgx-h100", "--sim-state",
                    str(sim), "--gpu", "all", *(["1g.10gb"] * 7)], check=True, capture_output=True)
    figures: dict[str, Any] = {"machine": "dgx-h100", "mig": "7x1g.10gb per GPU", "replicas": 4,
                               "nvml": "abi" if opts.abi else "python"}
    server = None if opts.no_kube else start_apiserver()
    node = "bench-daemon"
    try:
        cfg = work / "config.toml"
        lines = ['[device_plugin]\nconfig = "/etc/nodeagent/dp.yaml"', "[runtime]\nenabled = false"]
        if server is not None:
            make_node(server, node)
            lines.insert(0, f'kubeconfig = "{server.kubeconfig}"\nnode_name = "{node}"')
        else:
            lines.insert(0, "kube = false")
        cfg.write_text("\n".join(lines) + "\n")
        with running_harness() as harness, node_root(harness, sim_state=sim) as root:
            (root / "etc/nodeagent").mkdir(parents=True)
            (root / "etc/nodeagent/dp.yaml").write_text(DP_CONFIG)
            args = ["run", "--config", str(cfg), "--sim-state", str(root / "sim.json")]
            t_start = time.time()
            # Measured as deployed by default: with the metrics endpoint listening on localhost.
            with running_agent(work, root, args, metrics=f"127.0.0.1:{free_port()}") as agent:
                resource = "nvidia.com/mig-1g.10gb"
                agent.wait_notify("READY=1", timeout=60)
                t_ready = time.time()
                _, res = harness.wait(resource, registered=True, timeout=30)
                first = min(u.time for u in harness.updates(resource) if u.resource.registered)
                figures["start_to_register_s"] = round(first - t_start, 3)
                figures["start_to_ready_s"] = round(t_ready - t_start, 3)
                figures["devices_advertised"] = len(res.devices)
                proc = psutil.Process(agent.pid)
                if opts.abi:
                    maps = Path(f"/proc/{agent.pid}/maps").read_text()
                    figures["nvml_library_mapped"] = os.path.realpath(os.environ["NODEAGENT_NVML_LIBRARY"]) in maps
                time.sleep(3)  # let start-up publishing settle
                cpu0 = proc.cpu_times()
                t0 = time.monotonic()
                peak = 0
                while time.monotonic() - t0 < opts.idle:
                    peak = max(peak, proc.memory_info().rss)
                    time.sleep(1)
                cpu1 = proc.cpu_times()
                used = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
                figures["idle_window_s"] = opts.idle
                figures["idle_cpu_pct"] = round(100 * used / (time.monotonic() - t0), 3)
                figures["idle_rss_mib"] = round(proc.memory_info().rss / 2**20, 1)
                figures["idle_peak_rss_mib"] = round(peak / 2**20, 1)
                figures["threads"] = proc.num_threads()
                if server is not None:
                    t = time.monotonic()
                    set_label(server, node, "nvidia.com/mig.config", "all-3g.40gb")
                    def state() -> str | None:
                        assert server is not None
                        found: str | None = node_obj(server, node)["metadata"]["labels"].get(
                            "nvidia.com/mig.config.state")
                        return found

                    eventually(lambda: state() in ("success", "failed"), 120, "terminal state")
                    figures["mig_change_s"] = round(time.monotonic() - t, 3)
                    figures["mig_change_state"] = state()
                    resource = "nvidia.com/mig-3g.40gb"
                    harness.wait(resource, registered=True, timeout=30)
                fds0, thr0 = agent.fds(), agent.threads()
                times = []
                eventually(lambda: harness.resource(resource).capacity > 0, 30, f"{resource} devices listed")
                devices = len(harness.resource(resource).devices)
                figures["devices_after_change"] = devices
                for _ in range(opts.restarts):
                    times.append(restart_and_wait_registration(harness, resource, devices=devices, timeout=30))
                time.sleep(1)
                figures["kubelet_restarts"] = opts.restarts
                if times:
                    times.sort()
                    figures["reregister_p50_s"] = round(times[len(times) // 2], 3)
                    figures["reregister_max_s"] = round(times[-1], 3)
                figures["fds_before_after"] = [fds0, agent.fds()]
                figures["threads_before_after"] = [thr0, agent.threads()]
                code, took = agent.stop()
                figures["sigterm_exit"] = code
                figures["sigterm_s"] = round(took, 3)
    finally:
        if server is not None:
            server.stop()
    for k, v in figures.items():
        print(f"{k:24} {v}")
    if abi:
        from tests.bench.bench_abi import print_abi_figures

        print_abi_figures(abi)
        figures["abi"] = abi
    print(json.dumps({"bench": "daemon", **figures}))


if __name__ == "__main__":
    main()
