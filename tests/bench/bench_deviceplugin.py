"""Device-plugin benchmark: prints figures and one JSON line (no assertions on timings).

    .venv/bin/python tests/bench/bench_deviceplugin.py [--quick] [--no-sample] [--abi] [--kubelet-only]

``--kubelet-only`` measures only the figures against the kubelet's device manager (XID, restarts).

With --abi every NVML call of nodeagent (its servers, the kubelet part) goes through the real pynvml and
the stand-in libnvidia-ml.so.1 (after `source tests/testbin/setup.sh`), and the ABI overhead per NVML call
and the discovery time of dgx-h100 with 56 MIG devices are printed as well (tests/bench/bench_abi.py).

Measures, over real Unix sockets:
  * Allocate p50/p99 (1 device) of nodeagent's server, and of the Kubernetes sample device plugin in Go
    (k8s.io/kubernetes/test/images/sample-device-plugin) with the same Python gRPC client in the same run,
    both servers up at once and measured in alternating blocks of 100 calls, so both see the same machine
    load (a shared CI box drifts by more than the difference being measured), over several rounds, each
    round's ratio nodeagent/Go printed (compare ratios, not absolute figures from different moments).
    nodeagent runs with its default health settings (NVML events, a health poll each second), as on a node;
  * the same for servers that answer a constant through nodeagent's gRPC adapter (nodeagent.grpcadapter.server,
    same options and request parsing): grpc.aio on the event loop of a thread of its own
    (``LoopThreadServer``, what the device-plugin sockets run on, so the floor of that stack) and grpc.aio on
    the process's main event loop (``AioServer``, what the DRA sockets run on);
  * GetPreferredAllocation on dgx-h100 for sizes 1..8;
  * the pauses of each server child's cycle collector during those calls (count per 1000 calls, p50, max),
    which, unlike the latencies, a busy machine does not change much;
  * ListAndWatch of 896 devices (8 GPUs x 7 MIG x 16 replicas): first list, and re-send after an XID;
  * XID -> Unhealthy seen by the kubelet's device manager; kubelet restart -> re-registered (the kubelet's
    device manager lists the 8 devices allocatable again), p50/p99, after single restarts and after the
    second of two quick restarts (pauses of 0-12 ms, 50 ms, 200 ms and 1 s between them: the second one
    lands while the agent serves again after the first); with how often the agent took its own socket for another plugin's
    (``foreign``, 0 since the fix).
Servers run in a child process so client and server do not share an interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nodeagent.deviceplugin.api import pb2, pb2_grpc  # noqa: E402

# Put at the head of each server child: the pauses of Python's cycle collector, by generation, from the
# child's "ready" on, printed as one "gc {...}" line when the child ends (each pause stops the server's calls; in Go the collector runs
# concurrently, so these are much of the difference in the slowest Allocate answers).
GC_PROBE = r"""
import atexit as _atexit, gc as _gc, json as _json, time as _time
_gc_start, _gc_pauses = [0.0], {0: [], 1: [], 2: []}
def _gc_watch(phase, info):
    if phase == "start":
        _gc_start[0] = _time.perf_counter()
    else:
        _gc_pauses[info["generation"]].append(_time.perf_counter() - _gc_start[0])
_gc.callbacks.append(_gc_watch)
_atexit.register(lambda: print("gc " + _json.dumps(_gc_pauses), flush=True))
"""

SERVER = GC_PROBE + r"""
import asyncio, sys
from pathlib import Path
from nodeagent.deviceplugin.service import DevicePluginService
from nodeagent.nvmlsource import open_nvml
from nodeagent.gpu.health import HealthMonitorSettings
from nodeagent.sharing.spec import parse_plugin_config

async def main(plugin_dir, state, config):
    nvml = open_nvml(None, Path(state))
    svc = DevicePluginService(plugin_dir=Path(plugin_dir), plugin_config=parse_plugin_config(config), nvml=nvml,
                              health=HealthMonitorSettings(recovery_window_s=None),
                              backoff_max_s=60)
    await svc.start(nvml.discover())
    print("ready", flush=True); [v.clear() for v in _gc_pauses.values()]
    await asyncio.to_thread(sys.stdin.read)
    await svc.stop()
    nvml.close()

asyncio.run(main(*sys.argv[1:4]))
"""


# The least a server on nodeagent's stack can do per Allocate: answer a constant, through the same adapter
# (options, request parsing) as nodeagent's servers. Measured beside nodeagent and the Go plugin, it shows how
# much of the time is nodeagent's own work. argv: socket path, "loop" or "aio".
CONSTANT = GC_PROBE + r"""
import asyncio, sys
from pathlib import Path
from nodeagent.deviceplugin.api import pb2, pb2_grpc
from nodeagent.grpcadapter.server import AioServer, LoopThreadServer, RefusalLog, log

ANSWER = pb2.AllocateResponse(container_responses=[
    pb2.ContainerAllocateResponse(envs={"NVIDIA_VISIBLE_DEVICES": "GPU-00000000-0000-0000-0000-000000000000"})
])

class AioConstant:
    async def GetDevicePluginOptions(self, request, context): return pb2.DevicePluginOptions()
    async def ListAndWatch(self, request, context):
        return
        yield
    async def GetPreferredAllocation(self, request, context): return pb2.PreferredAllocationResponse()
    async def Allocate(self, request, context): return ANSWER
    async def PreStartContainer(self, request, context): return pb2.PreStartContainerResponse()

path, kind = Path(sys.argv[1]), sys.argv[4]
if kind == "loop":
    server = LoopThreadServer(path, [(pb2_grpc.add_DevicePluginServicer_to_server, AioConstant())],
                              refusals=RefusalLog(log))
    server.start()
    print("ready", flush=True); [v.clear() for v in _gc_pauses.values()]
    sys.stdin.read()
    server.stop(0)
else:
    async def main():
        server = AioServer(path, [(pb2_grpc.add_DevicePluginServicer_to_server, AioConstant())],
                           refusals=RefusalLog(log))
        await server.start()
        print("ready", flush=True); [v.clear() for v in _gc_pauses.values()]
        await asyncio.to_thread(sys.stdin.read)
        await server.stop(0)
    asyncio.run(main())
"""


# Pauses between two quick kubelet restarts: every half millisecond up to 12 ms (where the second restart lands
# while the agent serves again after the first; tests/e2e/test_run.py sweeps the same range), then longer ones.
QUICK_PAUSES_S = (*(i * 0.0005 for i in range(24)), 0.05, 0.2, 1.0)


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def ms(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(pct(values, 50) * 1e3, 3),
        "p99_ms": round(pct(values, 99) * 1e3, 3),
        "max_ms": round(max(values) * 1e3, 3),
        "n": len(values),
    }


def sim_state(tmp: Path, machine: str, layouts: dict[int, list[str]] | None = None) -> Path:
    from nodeagent.simulator.inject import write_mig_layout
    from nodeagent.simulator.state import SimStore

    path = tmp / f"{machine}-{len(list(tmp.iterdir()))}.json"
    store = SimStore.open(machine, path)
    for gpu, profiles in (layouts or {}).items():
        write_mig_layout(store, gpu, profiles)
    return path


class Child:
    """nodeagent's DevicePluginService (or another ``script``) in its own Python process."""

    def __init__(self, plugin_dir: Path, state: Path, config: str, script: str = SERVER, *extra: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, str(plugin_dir), str(state), config, *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError("device-plugin child did not start")
        self.gc_pauses: dict[int, list[float]] = {}

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            for line in self.proc.stdout.read().splitlines():
                if line.startswith("gc "):
                    self.gc_pauses = {int(g): v for g, v in json.loads(line[3:]).items()}
            self.proc.stdout.close()


CALLS: dict[str, int] = {}  # socket path → calls made to it (for the collector's pauses per call)


def counted(sock: Path, fn: Callable[[], Any]) -> Callable[[], Any]:
    def call() -> Any:
        CALLS[str(sock)] = CALLS.get(str(sock), 0) + 1
        return fn()

    return call


def gc_figures(child: Child, sock: Path) -> dict[str, Any]:
    """The child's collector pauses by generation: count per 1000 calls, p50 and max pause."""
    calls = max(1, CALLS.get(str(sock), 0))
    out: dict[str, Any] = {"calls": calls}
    for gen, pauses in sorted(child.gc_pauses.items()):
        if pauses:
            out[f"gen{gen}"] = {
                "per_1000_calls": round(len(pauses) * 1000 / calls, 2),
                **{k: v for k, v in ms(pauses).items() if k != "p99_ms"},
            }
    return out


def timed(fn: Callable[[], Any], n: int, warmup: int = 50) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def bench_allocate_pair(
    servers: dict[str, tuple[Path, str]], n: int, block: int = 100
) -> dict[str, dict[str, float]]:
    """Allocate latencies of each server (name → socket, device ID), measured in alternating blocks; the
    servers are warmed up with 100 calls each first, then with 5 before every block."""
    channels = {name: grpc.insecure_channel(f"unix://{sock}") for name, (sock, _) in servers.items()}
    try:
        calls = {}
        for name, (sock, device) in servers.items():
            stub = pb2_grpc.DevicePluginStub(channels[name])
            req = pb2.AllocateRequest(container_requests=[pb2.ContainerAllocateRequest(devices_ids=[device])])
            calls[name] = counted(sock, functools.partial(stub.Allocate, req, timeout=10))
        samples: dict[str, list[float]] = {name: [] for name in servers}
        for call in calls.values():
            timed(call, 0, warmup=100)
        while any(len(v) < n for v in samples.values()):
            for name, call in calls.items():
                samples[name] += timed(call, min(block, n - len(samples[name])), warmup=5)
        return {name: ms(v) for name, v in samples.items()}
    finally:
        for ch in channels.values():
            ch.close()


def bench_preferred(sock: Path, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        stub = pb2_grpc.DevicePluginStub(ch)
        ids = [d.ID for d in next(iter(stub.ListAndWatch(pb2.Empty()))).devices]
        for size in range(1, 9):
            req = pb2.PreferredAllocationRequest(
                container_requests=[
                    pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=ids, must_include_deviceIDs=ids[3:4], allocation_size=size
                    )
                ]
            )
            out[str(size)] = ms(
                timed(counted(sock, functools.partial(stub.GetPreferredAllocation, req, timeout=10)), n, warmup=10)
            )
    return out


def bench_list_896(tmp: Path, quick: bool) -> dict[str, Any]:
    from nodeagent.simulator.inject import inject_xid
    from nodeagent.simulator.state import SimStore

    state = sim_state(tmp, "dgx-h100", {g: ["1g.10gb"] * 7 for g in range(8)})
    config = (
        "version: v1\nflags:\n  migStrategy: single\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 16\n"
    )
    pdir = tmp / "dp896"
    child = Child(pdir, state, config)
    try:
        sock = pdir / "nvidia-gpu.sock"
        first: list[float] = []
        size = count = 0
        for _ in range(5 if quick else 20):
            with grpc.insecure_channel(f"unix://{sock}") as ch:
                stub = pb2_grpc.DevicePluginStub(ch)
                t = time.perf_counter()
                stream = stub.ListAndWatch(pb2.Empty())
                msg = next(stream)
                first.append(time.perf_counter() - t)
                size, count = msg.ByteSize(), len(msg.devices)
                stream.cancel()
        # re-send after an XID: time from injecting into the sim until the stream delivers the new list
        resend: list[float] = []
        store = SimStore.open(None, state)
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            stub = pb2_grpc.DevicePluginStub(ch)
            stream = stub.ListAndWatch(pb2.Empty())
            next(stream)
            for gpu in range(3 if quick else 8):
                t = time.perf_counter()
                inject_xid(store, gpu, 48)
                msg = next(stream)
                resend.append(time.perf_counter() - t)
                unhealthy = sum(1 for d in msg.devices if d.health == "Unhealthy")
                assert unhealthy == 112 * (gpu + 1), unhealthy
            stream.cancel()
        return {"devices": count, "bytes": size, "first_list": ms(first), "xid_resend": ms(resend)}
    finally:
        child.close()


async def bench_kubelet(tmp: Path, quick: bool) -> dict[str, Any]:
    from nodeagent.deviceplugin.service import DevicePluginService
    from nodeagent.gpu.health import HealthMonitorSettings
    from nodeagent.nvmlsource import open_nvml
    from nodeagent.simulator.inject import inject_xid
    from nodeagent.simulator.state import SimStore
    from tests.peers.harness import running_harness

    state = sim_state(tmp, "dgx-h100")
    store = SimStore.open(None, state)
    nvml = open_nvml(None, state)
    xid: list[float] = []
    restart: list[float] = []
    quick_restart: list[float] = []
    failures: list[str] = []  # every cause the service logged for not serving or registering
    foreign = 0

    class Causes(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            failures.append(record.getMessage())

    logging.getLogger("nodeagent.deviceplugin.service").addHandler(Causes(logging.WARNING))
    with running_harness() as h:
        svc = DevicePluginService(
            plugin_dir=h.plugin_dir,
            nvml=nvml,
            health=HealthMonitorSettings(recovery_window_s=0.3, poll_interval_s=0.05, event_wait_ms=50),
        )
        await svc.start(nvml.discover())
        try:
            await asyncio.to_thread(h.wait, "nvidia.com/gpu", total=8, healthy=8, registered=True)
            ids = svc.served_resources()["nvidia.com/gpu"]
            for i in range(3 if quick else 8):
                t = time.time()
                inject_xid(store, i, 79 if i % 2 else 48)
                seen, _ = await asyncio.to_thread(h.wait, "nvidia.com/gpu", device=ids[i], health="Unhealthy")
                xid.append(seen - t)
                await asyncio.to_thread(h.wait, "nvidia.com/gpu", healthy=8, timeout=10)

            async def back_after(restart_first: float | None) -> float:
                """Restart the kubelet (after another restart and a pause of ``restart_first`` s, if given);
                seconds from the (last) restart until the manager lists our 8 devices allocatable again."""
                if restart_first is not None:
                    await asyncio.to_thread(h.restart)
                    await asyncio.sleep(restart_first)
                # the restarted manager first shows the resource empty, then our devices again (the harness
                # records every change it polls, every 2 ms, with its time); when the agent has not registered
                # again since the first restart, the resource is empty already and stays so until it has
                now = (await asyncio.to_thread(h.resources)).get("nvidia.com/gpu")
                empty = now is None or now.allocatable < 8
                seq = max((u.seq for u in h.updates()), default=0)
                t = time.time()
                await asyncio.to_thread(h.restart)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    dipped = empty
                    for u in await asyncio.to_thread(h.updates, "nvidia.com/gpu", seq):
                        if u.resource.allocatable < 8:
                            dipped = True
                        elif dipped and u.time >= t:
                            return u.time - t
                    await asyncio.sleep(0.005)
                raise AssertionError("no re-registration seen after a kubelet restart")

            for _ in range(3 if quick else 20):
                restart.append(await back_after(None))
            for i in range(4 if quick else len(QUICK_PAUSES_S)):
                quick_restart.append(await back_after(QUICK_PAUSES_S[i % len(QUICK_PAUSES_S)]))
            foreign = sum(1 for m in failures if "served by another process" in m)
        finally:
            await svc.stop()
            nvml.close()
    return {"xid_to_unhealthy": ms(xid), "restart_to_registered": ms(restart),
            "quick_restart_to_registered": {**ms(quick_restart), "foreign": foreign}}


def sample_plugin_binary() -> Path | None:
    value = os.environ.get("NODEAGENT_SAMPLE_DEVICE_PLUGIN")
    if not value:
        script = (
            f"NODEAGENT_PEERS_LIB_ONLY=1; source {ROOT}/tests/testbin/setup.sh; "
            'nodeagent_peers_sample_device_plugin >&2 && printf %s "$NODEAGENT_SAMPLE_DEVICE_PLUGIN"'
        )
        proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(f"sample device plugin unavailable: {proc.stderr.strip()[-500:]}", file=sys.stderr)
            return None
        value = proc.stdout.strip()
    return Path(value)


class SamplePlugin:
    """The Kubernetes sample device plugin (Go), serving without registering."""

    def __init__(self, binary: Path, tmp: Path) -> None:
        sdir = tmp / "sample"
        sdir.mkdir()
        # REGISTER_CONTROL_FILE: serve without registering (its kubelet path is fixed to /var/lib/kubelet).
        env = dict(os.environ, PLUGIN_SOCK_DIR=str(sdir), REGISTER_CONTROL_FILE=str(tmp / "ctl" / "register"))
        (tmp / "ctl").mkdir()
        self.proc = subprocess.Popen(
            [str(binary)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        socks: list[Path] = []
        while time.monotonic() < deadline and not socks:
            socks = [p for p in sdir.iterdir() if p.name.startswith("dp.")]
            time.sleep(0.05)
        if not socks:
            self.close()
            raise RuntimeError("sample device plugin did not create its socket")
        time.sleep(0.2)
        self.socket = socks[0]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--no-sample", action="store_true", help="skip the Go sample device plugin")
    ap.add_argument("--rounds", type=int, default=3, help="Allocate rounds (each measures every server)")
    ap.add_argument("--kubelet-only", action="store_true",
                    help="only the figures against the kubelet's device manager (XID, restarts)")
    ap.add_argument(
        "--abi", action="store_true", help="nodeagent on the real pynvml over the stand-in library"
    )
    args = ap.parse_args()
    n = 300 if args.quick else 3000
    result: dict[str, Any] = {"bench": "deviceplugin", "nvml": "abi" if args.abi else "python"}
    if args.abi:
        from tests.bench.bench_abi import abi_environment, abi_figures

        os.environ.update(abi_environment())  # this process and every server child
        result["abi"] = abi_figures(with_go=False)
    if args.kubelet_only:
        with tempfile.TemporaryDirectory(prefix="na-dpbench-") as t:
            result.update(asyncio.run(bench_kubelet(Path(t), args.quick)))
        print_kubelet_figures(result)
        print(json.dumps(result, sort_keys=True))
        return
    with tempfile.TemporaryDirectory(prefix="na-dpbench-") as t:
        tmp = Path(t)
        state = sim_state(tmp, "dgx-h100")
        pdir = tmp / "dp"
        child = Child(pdir, state, "version: v1\n")
        own_loop = Child(tmp / "loop.sock", state, "", CONSTANT, "loop")
        aio = Child(tmp / "aio.sock", state, "", CONSTANT, "aio")
        sample: SamplePlugin | None = None
        try:
            with grpc.insecure_channel(f"unix://{pdir / 'nvidia-gpu.sock'}") as ch:
                first = next(pb2_grpc.DevicePluginStub(ch).ListAndWatch(pb2.Empty())).devices[0].ID
            servers = {
                "allocate_nodeagent": (pdir / "nvidia-gpu.sock", first),
                "allocate_loop_constant": (tmp / "loop.sock", first),
                "allocate_aio_constant": (tmp / "aio.sock", first),
            }
            binary = None if args.no_sample else sample_plugin_binary()
            if binary is not None:
                sample = SamplePlugin(binary, tmp)
                servers["allocate_k8s_sample_go"] = (sample.socket, "Dev-1")
            rounds = [bench_allocate_pair(servers, n) for _ in range(max(1, args.rounds))]
            result["allocate_rounds"] = rounds
            result.update(rounds[-1])
            result["preferred_dgx_h100"] = bench_preferred(
                pdir / "nvidia-gpu.sock", 50 if args.quick else 300
            )
        finally:
            if sample is not None:
                sample.close()
            own_loop.close()
            aio.close()
            child.close()
        result["gc"] = {
            "nodeagent": gc_figures(child, pdir / "nvidia-gpu.sock"),
            "loop_constant": gc_figures(own_loop, tmp / "loop.sock"),
            "aio_constant": gc_figures(aio, tmp / "aio.sock"),
        }
        result["list_and_watch_896"] = bench_list_896(tmp, args.quick)
        result.update(asyncio.run(bench_kubelet(tmp, args.quick)))

    for i, r in enumerate(result["allocate_rounds"]):
        a, f, g = r["allocate_nodeagent"], r["allocate_loop_constant"], r["allocate_aio_constant"]
        line = (
            f"Allocate round {i + 1} (n={a['n']} each): nodeagent p50 {a['p50_ms']} p99 {a['p99_ms']} ms; "
            f"constant on grpc.aio on its own loop p50 {f['p50_ms']} p99 {f['p99_ms']} ms; "
            f"constant on grpc.aio on the main loop p50 {g['p50_ms']} p99 {g['p99_ms']} ms"
        )
        if "allocate_k8s_sample_go" in r:
            s = r["allocate_k8s_sample_go"]
            line += (
                f"; Go sample p50 {s['p50_ms']} p99 {s['p99_ms']} ms; nodeagent/Go p50 "
                f"{a['p50_ms'] / s['p50_ms']:.2f} p99 {a['p99_ms'] / s['p99_ms']:.2f}"
            )
        print(line)
    for size, r in result["preferred_dgx_h100"].items():
        print(f"GetPreferredAllocation size {size}:    p50 {r['p50_ms']} ms  p99 {r['p99_ms']} ms")
    lw = result["list_and_watch_896"]
    print(
        f"ListAndWatch {lw['devices']} devices ({lw['bytes']} B): first list p50 {lw['first_list']['p50_ms']} ms "
        f"p99 {lw['first_list']['p99_ms']} ms; XID re-send p50 {lw['xid_resend']['p50_ms']} ms "
        f"max {lw['xid_resend']['max_ms']} ms"
    )
    for name, g in result["gc"].items():
        gens = "; ".join(
            f"{gen} {v['per_1000_calls']} per 1000 calls, pause p50 {v['p50_ms']} max {v['max_ms']} ms"
            for gen, v in g.items()
            if gen != "calls"
        )
        print(f"cycle collector of {name} ({g['calls']} calls): {gens}")
    print_kubelet_figures(result)
    if args.abi:
        from tests.bench.bench_abi import print_abi_figures

        print_abi_figures(result["abi"])
    print(json.dumps(result, sort_keys=True))


def print_kubelet_figures(result: dict[str, Any]) -> None:
    x, r, q = result["xid_to_unhealthy"], result["restart_to_registered"], result["quick_restart_to_registered"]
    print(f"XID -> Unhealthy at kubelet:        p50 {x['p50_ms']} ms  max {x['max_ms']} ms")
    print(f"kubelet restart -> re-registered:   p50 {r['p50_ms']} ms  p99 {r['p99_ms']} ms  max {r['max_ms']} ms "
          f"(n={r['n']})")
    print(f"two quick kubelet restarts -> re-registered after the second: p50 {q['p50_ms']} ms  p99 {q['p99_ms']} ms  "
          f"max {q['max_ms']} ms (n={q['n']}); own socket taken for another plugin's: {q['foreign']} time(s)")


if __name__ == "__main__":
    main()
