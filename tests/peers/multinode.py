"""A cluster of several real nodes on this one machine, for tests/cluster: the single-node cluster of
tests/peers/cluster.py (its control plane, and its node on the host's own paths and network) and beside it
further nodes, each with its own kubelet, containerd, CNI bridge network and simulated GPUs.

Each further node lives in namespaces of its own, held by one ``sleep`` process made by ``unshare``:

* a mount namespace (private propagation) where the node's own directories are bound over the host paths a
  node owns (the kubelet's, containerd's socket, state and config, the CDI spec directories, the agent's
  state and run directories, the stand-in driver's machine file and MPS control program, the kubelet's pod
  logs), so the DaemonSet's hostPath volumes, which runc resolves in its parent's mount namespace, are that
  node's;
* a network namespace joined to the host by a veth pair: the host side ``10.243.N.1/30``, the node's address
  ``10.243.N.2`` (its kubelet's ``--node-ip``), its pods on ``10.244.(76+N).0/24`` (the first node's is
  10.244.77.0/24). The host routes each node's pod network to its link; a node routes only the cluster's
  ranges, the host's address and the ``kubernetes`` Service's to the host, so nothing of a node is sent to
  any address outside these;
* cgroups under ``/nodeagent-<node>`` (the kubelet's ``cgroupRoot``) in every cgroup v1 hierarchy.

The kubelet of such a node reaches the apiserver as pods do, at the ``kubernetes`` Service address (the
host's DNAT rule; the serving certificate names 10.0.0.1). Everything is removed at the end: the namespaces go
with their processes, the veth with its namespace, the cgroups and directories are removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tests.peers.apiserver import write_kubeconfig
from tests.peers.cluster import (
    CDI_DIR,
    CONTAINERD_CONFIG,
    CONTAINERD_SOCKET,
    DRIVER_DIR,
    IMEX_CTL,
    IMEX_DAEMON,
    KUBELET_DIR,
    MACHINE,
    MPS_CONTROL,
    NODE_NAME,
    NVIDIA_SMI,
    SERVICE_IP,
    SIM_STATE,
    Cluster,
    NodePeers,
    _HostChanges,
    _run,
    in_memory_cgroup,
    node_peers,
    remove_cgroup,
    running_cluster,
    start_node_runtime,
    write_machine,
)

# the simulated machine of each node, in order (the first is the single-node cluster's)
MACHINES = (MACHINE, "gb200-nvl", "gb300-nvl", "hgx-h200")
LINKS = "10.243.0.0/16"  # one /30 per further node: 10.243.N.0/30
PODS = "10.244.0.0/16"  # one /24 per node: 10.244.(76+N).0/24
# the host paths a node owns, bound over by each further node's own (CONTAINERD_CONFIG's directory whole; the
# kubelet's pod logs too: a kubelet removes the log directories of pods it does not know)
NODE_DIRS = (KUBELET_DIR, CONTAINERD_SOCKET.parent, CONTAINERD_CONFIG.parent, CDI_DIR, Path("/etc/cdi"),
             Path("/run/nodeagent"), SIM_STATE.parents[1], Path("/etc/nvidia-container-runtime"),
             Path("/run/systemd"), Path("/var/log/pods"), Path("/var/log/containers"), Path("/etc/nvidia-imex"))
NODE_FILES = (DRIVER_DIR / "nodeagent-sim.conf", MPS_CONTROL, NVIDIA_SMI, IMEX_DAEMON, IMEX_CTL)
# the kernel module's IMEX channel device as a further node's driver registers it: a line of that node's own
# /proc/devices (a copy of the host's bound over it in the node's mount namespace); the agent makes the channel
# devices with it (in the host's /dev, which the nodes share: removed at the end)
IMEX_CHANNELS = ("nvidia-caps-imex-channels", 509)
IMEX_CHANNEL_DIR = Path("/dev/nvidia-caps-imex-channels")
CGROUPS = Path("/sys/fs/cgroup")


def node_name(index: int) -> str:
    """The name of node ``index`` (1-based; node 1 is the single-node cluster's)."""
    return NODE_NAME if index == 1 else f"{NODE_NAME}-{index}"


def pod_subnet(index: int) -> str:
    return f"10.244.{76 + index}.0/24"


def link(index: int) -> tuple[str, str]:
    """The host's and the node's address on node ``index``'s link."""
    return f"10.243.{index}.1", f"10.243.{index}.2"


@dataclass
class _Namespaces:
    """What a further node holds of the machine: its namespaces' holder, the host's end of its veth, its
    cgroups."""

    holder: subprocess.Popen[bytes]
    veth: str
    cgroup: str  # the kubelet's cgroupRoot
    cgroups: list[Path] = field(default_factory=list)

    def members(self, cgroup: str | None = None) -> list[int]:
        """The processes in the node's network namespace (the holder's excepted) and, given the node's
        ``cgroup`` root, those in it or in cgroups below it (its pods' containers, in network namespaces of their own)."""
        own = os.readlink(f"/proc/{self.holder.pid}/ns/net")
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != self.holder.pid:
                with contextlib.suppress(OSError):
                    if os.readlink(entry / "ns" / "net") == own or (
                            cgroup is not None and in_memory_cgroup(entry, [cgroup])):
                        pids.append(int(entry.name))
        return pids

    def remove(self) -> list[str]:
        problems: list[str] = []
        for pid in self.members(self.cgroup):  # what the node's containerd started and left (its shims, their children)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.holder.kill()
        self.holder.wait(timeout=20)
        deadline = time.monotonic() + 20
        while _run(["ip", "link", "show", self.veth], check=False).returncode == 0:
            if time.monotonic() > deadline:
                _run(["ip", "link", "delete", self.veth], check=False)
                break
            time.sleep(0.2)
        for top in self.cgroups:
            problems += remove_cgroup(top)
        return problems


@dataclass
class SeveralNodes:
    """The running nodes; ``first`` is the single-node cluster (the control plane's kubectl, its node on the
    host's own paths), ``nodes`` all of them in order."""

    first: Cluster
    others: list[Cluster]
    machines: dict[str, str]  # node name -> simulated machine
    started: dict[str, float]  # node name -> seconds its start took (the further nodes': started together)
    _spaces: dict[str, _Namespaces] = field(default_factory=dict, repr=False)

    @property
    def nodes(self) -> list[Cluster]:
        return [self.first, *self.others]

    def node(self, name: str) -> Cluster:
        return next(n for n in self.nodes if n.node_name == name)

    def usage(self, name: str) -> tuple[int, int]:
        """(resident KiB, CPU clock ticks used so far) of the processes of further node ``name``: its kubelet,
        containerd, shims and its pods' containers."""
        rss = ticks = 0
        spaces = self._spaces[name]
        for pid in spaces.members(spaces.cgroup):
            with contextlib.suppress(OSError):
                status = Path(f"/proc/{pid}/status").read_text()
                rss += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return rss, ticks

    def remove(self, name: str) -> list[str]:
        """Further node ``name`` leaves the cluster: its kubelet, containerd, pods and namespaces gone, its Node
        deleted; the problems found while cleaning (empty: clean)."""
        node = self.node(name)
        assert node is not self.first, "node 1 holds the control plane"
        self.others.remove(node)
        node.stop_node()
        problems = self._spaces.pop(name).remove()
        shutil.rmtree(node.workdir, ignore_errors=True)
        self.first.kubectl("delete", "node", name, "--wait=false")
        return problems

    def stop_others(self) -> list[str]:
        problems: list[str] = []
        for node in reversed(self.others):
            node.stop_node()
            problems += self._spaces.pop(node.node_name).remove()
            shutil.rmtree(node.workdir, ignore_errors=True)
        self.others.clear()
        return problems


def _with_imex_channels(text: str) -> str:
    """``/proc/devices`` with the IMEX channels' character device added at the end of its character devices."""
    name, major = IMEX_CHANNELS
    chars, sep, rest = text.partition("\n\nBlock devices:")
    return f"{chars}\n{major:3d} {name}{sep}{rest}"


def _check_ranges_free() -> None:
    routes = _run(["ip", "-4", "route", "show"]).stdout
    for prefix in ("10.243.", *(f"10.244.{76 + i}." for i in range(2, len(MACHINES) + 1))):
        if prefix in routes:
            raise RuntimeError(f"this host routes {prefix}x already: the several-node cluster needs {LINKS} and "
                               f"{PODS} for itself\n{routes}")


def _holder() -> subprocess.Popen[bytes]:
    """A process in a new mount (private propagation) and network namespace, holding them while it lives."""
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--net", "sleep", "infinity"],
                              stdin=subprocess.DEVNULL, start_new_session=True)
    own = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{holder.pid}/ns/net") != own:
                return holder
        if holder.poll() is not None:
            raise RuntimeError(f"unshare exited {holder.returncode}")
        time.sleep(0.05)
    holder.kill()
    raise RuntimeError("unshare made no network namespace within 10s")


def _cgroups(name: str, host: _HostChanges) -> list[Path]:
    """``/<name>`` in every cgroup v1 hierarchy (cpuset's given its parent's CPUs and memory nodes), each in
    the cluster's journal of host changes before it is made."""
    made = []
    for hierarchy in sorted(CGROUPS.iterdir()):
        if not hierarchy.is_dir() or not os.path.ismount(hierarchy):
            continue
        d = hierarchy / name
        host.add_cgroup(d)
        d.mkdir()
        made.append(d)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (hierarchy / knob).is_file():
                (d / knob).write_text((hierarchy / knob).read_text())
    return made


def _add_node(first: Cluster, peers: NodePeers, index: int, machine: str) -> tuple[Cluster, _Namespaces]:
    name = node_name(index)
    workdir = Path(tempfile.mkdtemp(prefix=f"nodeagent-{name}-"))
    holder = _holder()
    spaces = _Namespaces(holder=holder, veth=f"natest-n{index}", cgroup=f"/nodeagent-{name}")
    enter = ("nsenter", f"--target={holder.pid}", "--mount", "--net", "--")
    host_end, node_ip = link(index)
    node = Cluster(apiserver=first.apiserver, workdir=workdir, kubectl_bin=first.kubectl_bin,
                   kubelet_bin=first.kubelet_bin, node_name=name, host_ip=first.host_ip, images=first.images,
                   imported=("pause", "base", "agent"), enter=enter, root=workdir / "root", node_ip=node_ip,
                   kubelet_kubeconfig=workdir / "kubeconfig")
    try:
        # the network: the veth, the node's routes to the host (only the cluster's addresses), forwarding
        _run(["ip", "link", "add", spaces.veth, "type", "veth", "peer", "name", "eth0", "netns", str(holder.pid)])
        _run(["ip", "addr", "add", f"{host_end}/30", "dev", spaces.veth])
        _run(["ip", "link", "set", spaces.veth, "up"])
        in_net = ["nsenter", f"--target={holder.pid}", "--net", "--"]
        for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{node_ip}/30", "dev", "eth0"],
                    ["ip", "link", "set", "eth0", "up"],
                    *(["ip", "route", "add", dst, "via", host_end]
                      for dst in (f"{SERVICE_IP}/32", f"{first.host_ip}/32", PODS, LINKS)),
                    ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"]):
            _run([*in_net, *cmd])
        _run(["ip", "route", "add", pod_subnet(index), "via", node_ip])
        # the node's own host paths, bound over the host's in its mount namespace
        for d in NODE_DIRS:
            node.host_path(d).mkdir(parents=True, exist_ok=True)

        def write(path: Path, data: bytes, mode: int) -> None:
            target = node.host_path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            target.chmod(mode)

        write_machine(write, machine)
        for d in NODE_DIRS:  # the first node's cluster removes at its end the ones it did not find there
            d.mkdir(parents=True, exist_ok=True)
        for path in (*NODE_DIRS, *NODE_FILES):
            _run([*enter, "mount", "--bind", str(node.host_path(path)), str(path)])
        devices = workdir / "proc-devices"
        devices.write_text(_with_imex_channels(Path("/proc/devices").read_text()))
        _run([*enter, "mount", "--bind", "-o", "ro", str(devices), "/proc/devices"])
        spaces.cgroups = _cgroups(spaces.cgroup.lstrip("/"), first._host)
        write_kubeconfig(workdir / "kubeconfig", f"https://{SERVICE_IP}:443", first.apiserver.workdir / "pki")
        start_node_runtime(node, peers, write, subnet=pod_subnet(index), cgroup_root=spaces.cgroup,
                           netns_dir=str(CONTAINERD_SOCKET.parent / "netns"))
    except BaseException:
        node.stop_node()
        spaces.remove()
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return node, spaces


@contextlib.contextmanager
def running_nodes(count: int, imported: Sequence[str] = ("pause", "base", "agent")) -> Iterator[SeveralNodes]:
    """``count`` nodes (2 to len(MACHINES)): the single-node cluster (its containerd importing ``imported``) and
    ``count - 1`` further nodes (each importing every image), node N simulating ``MACHINES[N-1]``."""
    if not 2 <= count <= len(MACHINES):
        raise ValueError(f"nodes: {count} (2 to {len(MACHINES)})")
    peers = node_peers()
    _check_ranges_free()
    channels_there = IMEX_CHANNEL_DIR.exists()
    start = time.monotonic()
    with running_cluster(imported) as first:
        nodes = SeveralNodes(first=first, others=[], machines={first.node_name: MACHINE},
                             started={first.node_name: time.monotonic() - start})
        try:
            began = time.monotonic()

            def add(index: int) -> tuple[Cluster, _Namespaces, float]:
                node, spaces = _add_node(first, peers, index, MACHINES[index - 1])
                return node, spaces, time.monotonic() - began

            # the further nodes start side by side (their image imports and kubelets overlap)
            with ThreadPoolExecutor(max_workers=count - 1, thread_name_prefix="node") as pool:
                futures = [pool.submit(add, index) for index in range(2, count + 1)]
            failed: list[BaseException] = []
            for index, future in enumerate(futures, start=2):
                try:
                    node, spaces, took = future.result()
                except BaseException as e:  # raised below, once the others are registered for the stop
                    failed.append(e)
                    continue
                nodes.others.append(node)
                nodes._spaces[node.node_name] = spaces
                nodes.machines[node.node_name] = MACHINES[index - 1]
                nodes.started[node.node_name] = took
            if failed:
                raise failed[0]
            yield nodes
        finally:
            # the pods go first (the first node's stop deletes them all), then the further nodes
            with contextlib.suppress(Exception):
                first.kubectl("delete", "pods", "--all", "-A", "--grace-period=0", "--force", "--wait=false",
                              check=False, timeout=30)
            problems = nodes.stop_others()
            if not channels_there:
                shutil.rmtree(IMEX_CHANNEL_DIR, ignore_errors=True)
            if problems:
                raise RuntimeError("the further nodes did not leave the host clean: " + "; ".join(problems))


__all__ = ["MACHINES", "SeveralNodes", "node_name", "pod_subnet", "running_nodes"]
