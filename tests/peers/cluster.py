"""A single-node Kubernetes cluster from real parts, for tests/cluster: the README's Kubernetes section on it.

Parts (all built or installed by tests/testbin/setup.sh before pytest starts):

* etcd + kube-apiserver v1.34.4 (``tests.peers.apiserver``; here with the ServiceAccount admission plugin, so
  pods get their projected service-account token, listening on all addresses and advertising the host's
  address), kube-controller-manager (every default controller: DaemonSets, service accounts, the root CA
  ConfigMap, garbage collection, namespaces, ResourceClaims) and kube-scheduler;
* the real kubelet v1.34.4 (NODEAGENT_KUBELET, ``--cgroup-driver=cgroupfs``: systemd is not PID 1 here),
  ``kubectl`` of the same release (NODEAGENT_KUBECTL);
* containerd 2.4 (NODEAGENT_CONTAINERD2, its runc shim, Debian's runc: NODEAGENT_RUNC) on the host's default socket
  ``/run/containerd/containerd.sock`` with its config in ``/etc/containerd/config.toml`` (the paths the
  DaemonSet mounts), restarted whenever it exits as systemd would (the agent's bootstrap restarts it with a
  signal); Debian's CNI plugins with a bridge network; the pause, Debian base and nodeagent images imported
  from their archives (``running_cluster(imported=...)`` names the ones to import: a test that lets containerd
  pull the agent's image from a registry of its own, tests/peers/registry.py, imports the other two);
* the GPUs: the NVML ABI stand-in (NODEAGENT_NVML_LIBRARY) installed as the host driver's
  ``/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1`` with ``nodeagent-sim.conf`` beside it (the simulated
  machine and its state file ``/var/lib/nodeagent/sim/state.json``, on the host), and ``/dev/nvidia*``
  character devices with NVIDIA's major numbers, so runc creates them in the containers that get them;
  the simulator's stand-ins ``nvidia-cuda-mps-control`` and ``nvidia-smi`` (resets only) installed as the
  driver's ``/usr/bin`` programs (``MPS_CONTROL_STAND_IN``, ``SMI_STAND_IN``: the agent runs them from its
  container, where it finds them under ``/host``).

This machine's root lacks CAP_SYS_RESOURCE, so no process may lower its oom_score_adj below 0, and the
kubelet asks for -998 (pod sandboxes) and -997 (critical and Guaranteed pods): runc then fails with
"nsexec: failed to update /proc/self/oom_score_adj: Permission denied". Where the capability is missing,
containerd runs runc through a wrapper that raises a negative ``process.oomScoreAdj`` of the bundle's
config.json to 0 before ``runc create`` (``RUNC_WRAPPER``); nothing else of the spec changes.

No kube-proxy runs: the one Service the agent needs, ``kubernetes`` (10.0.0.1:443), is reached through
iptables DNAT rules to the apiserver (for pods, and for the host's own network), as kube-proxy would write them.

The kubelet's plugin directories are fixed host paths (``/var/lib/kubelet/device-plugins`` whatever
``--root-dir`` says), so the cluster owns these host paths while it runs: one cluster per test session
(``running_cluster``), refused when another kubelet or containerd already serves them; everything it
created is removed at the end and every host file it changed is restored.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from tests.peers._proc import stop_process, tail
from tests.peers._resolve import PeerMissingError, peer_binary, system_binary
from tests.peers.apiserver import KubeApiServer, free_port, start_apiserver

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "packaging" / "kubernetes"
NODE_NAME = "nodeagent-node"
MACHINE = "dgx-h100"
GPU_COUNT = 8
CONTAINERD_SOCKET = Path("/run/containerd/containerd.sock")
CONTAINERD_CONFIG = Path("/etc/containerd/config.toml")
KUBELET_DIR = Path("/var/lib/kubelet")
DRIVER_DIR = Path("/usr/lib/x86_64-linux-gnu")
CDI_DIR = Path("/var/run/cdi")  # where the agent writes its CDI specs (the DaemonSet's cdi-run volume)
MPS_CONTROL = Path("/usr/bin/nvidia-cuda-mps-control")  # where NVIDIA's driver installs it
NVIDIA_SMI = Path("/usr/bin/nvidia-smi")  # the driver's nvidia-smi: GPU resets of the remediation
# the host-managed IMEX daemon and its query tool, where NVIDIA's driver installs them ([imex] of the agent)
IMEX_DAEMON = Path("/usr/bin/nvidia-imex")
IMEX_CTL = Path("/usr/bin/nvidia-imex-ctl")
SIM_STATE = Path("/var/lib/nodeagent/sim/state.json")
SERVICE_IP = "10.0.0.1"
POD_SUBNET = "10.244.77.0/24"
BRIDGE = "natest0"
NVIDIA_MAJOR = 195
UVM_MAJOR = 510  # dynamic on a real host (/proc/devices "nvidia-uvm"); any free major will do for runc
READY_TIMEOUT = 120.0
# host paths the cluster may create; removed at the end when they did not exist before
OWNED_PATHS = (KUBELET_DIR, KUBELET_DIR / "device-plugins", Path("/var/lib/nodeagent"), Path("/var/run/cdi"), Path("/etc/cdi"),
               Path("/etc/nvidia-container-runtime"), Path("/run/systemd"), Path("/run/containerd"),
               Path("/run/nodeagent"), Path("/etc/nvidia-imex"), Path("/etc/containerd/conf.d"), Path("/var/lib/cni"),
               Path("/dev/nvidia-caps-imex-channels"))
# the network namespaces containerd pins for pods: those a run left (pods killed without their CNI DEL) go at the end
NETNS_DIR = Path("/run/netns")
# what a running cluster has done to the host, written before each change: a run that never reached its stop
# (killed, or the machine saved and restored mid-run) is undone by the next cluster's start
JOURNAL = Path("/var/tmp/nodeagent-test-cluster.json")

def _host_ip() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: only the route's source address is read
        ip: str = s.getsockname()[0]
    return ip


def _run(cmd: Sequence[str], *, check: bool = True, timeout: float = 120.0,
         input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False, timeout=timeout, input=input_text)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc


@dataclass
class _HostChanges:
    """What the cluster did to the host, undone in reverse order by ``undo``. With a ``journal``, each change is
    written there before it is made, so another process can undo it (``undo_interrupted``)."""

    files: dict[Path, bytes | None] = field(default_factory=dict)  # path -> original bytes (None: absent)
    created_dirs: list[Path] = field(default_factory=list)
    existing_dirs: dict[Path, set[str]] = field(default_factory=dict)  # dir -> the entries it had before
    created_nodes: list[Path] = field(default_factory=list)
    iptables: list[list[str]] = field(default_factory=list)
    netns_before: set[str] | None = None  # NETNS_DIR's entries before the cluster (None: not looked at)
    scratch: list[Path] = field(default_factory=list)  # the run's own directories (workdirs), removed by a recovery
    cgroups: list[Path] = field(default_factory=list)  # cgroup directories of further nodes, removed with their subtree
    pod_cgroups: list[str] = field(default_factory=list)  # the first kubelet's cgroup root (its pods below)
    journal: Path | None = None
    _saving: threading.Lock = field(default_factory=threading.Lock, repr=False)  # nodes start side by side

    def _save_locked(self) -> None:
        """Write the journal (the caller holds ``_saving``)."""
        journal = self.journal
        if journal is None:
            return
        record = {
            "pid": os.getpid(), "started": psutil.Process().create_time(),
            "files": {str(p): None if b is None else base64.b64encode(b).decode() for p, b in self.files.items()},
            "created_dirs": [str(d) for d in self.created_dirs],
            "existing_dirs": {str(d): sorted(names) for d, names in self.existing_dirs.items()},
            "created_nodes": [str(n) for n in self.created_nodes], "iptables": self.iptables,
            "netns_before": None if self.netns_before is None else sorted(self.netns_before),
            "scratch": [str(d) for d in self.scratch], "cgroups": [str(d) for d in self.cgroups],
            "pod_cgroups": self.pod_cgroups}
        tmp = journal.with_name(f".{journal.name}.tmp")
        with tmp.open("w", encoding="utf-8") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, journal)

    @classmethod
    def load(cls, journal: Path) -> tuple[_HostChanges, int, float]:
        """The changes a journal holds, the process that made them and its start time."""
        record = json.loads(journal.read_text(encoding="utf-8"))
        host = cls(files={Path(p): None if b is None else base64.b64decode(b) for p, b in record["files"].items()},
                   created_dirs=[Path(d) for d in record["created_dirs"]],
                   existing_dirs={Path(d): set(names) for d, names in record["existing_dirs"].items()},
                   created_nodes=[Path(n) for n in record["created_nodes"]],
                   iptables=[list(r) for r in record["iptables"]],
                   netns_before=None if record["netns_before"] is None else set(record["netns_before"]),
                   scratch=[Path(d) for d in record["scratch"]], cgroups=[Path(d) for d in record["cgroups"]],
                   pod_cgroups=list(record["pod_cgroups"]), journal=journal)
        return host, int(record["pid"]), float(record["started"])

    def write(self, path: Path, data: bytes, mode: int = 0o644) -> None:
        if path not in self.files:
            with self._saving:
                self.files[path] = path.read_bytes() if path.is_file() else None
                self._save_locked()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.nodeagent-test")
        tmp.write_bytes(data)
        tmp.chmod(mode)
        os.replace(tmp, path)

    def _journaled(self, to: list[Any], item: Any) -> None:
        """Add ``item`` to one of the lists and write the journal, before the change it names is made."""
        with self._saving:
            to.append(item)
            self._save_locked()

    def make_node(self, path: Path, major: int, minor: int) -> None:
        self._journaled(self.created_nodes, path)
        os.mknod(path, 0o666 | 0o020000, os.makedev(major, minor))

    def add_rule(self, rule: list[str]) -> None:
        self._journaled(self.iptables, rule)
        _run(["iptables", "-t", "nat", "-A", *rule])

    def add_cgroup(self, path: Path) -> None:
        self._journaled(self.cgroups, path)

    def add_scratch(self, path: Path) -> None:
        self._journaled(self.scratch, path)

    def own_dirs(self) -> None:
        for d in OWNED_PATHS:
            if d.is_dir():
                self.existing_dirs[d] = {p.name for p in d.iterdir()}
            elif not d.exists():
                self.created_dirs.append(d)
        self.netns_before = {p.name for p in NETNS_DIR.iterdir()} if NETNS_DIR.is_dir() else set()
        with self._saving:
            self._save_locked()

    def undo(self) -> list[str]:
        problems: list[str] = []
        for rule in reversed(self.iptables):
            if _run(["iptables", "-t", "nat", "-C", *rule], check=False).returncode != 0:
                continue  # not there (a recovery after a restart, or never added)
            if _run(["iptables", "-t", "nat", "-D", *rule], check=False).returncode != 0:
                problems.append(f"iptables rule {rule} could not be removed")
        for node in self.created_nodes:
            with contextlib.suppress(FileNotFoundError):
                node.unlink()
        with contextlib.suppress(OSError):
            Path("/dev/nvidia-caps").rmdir()
        for path, original in self.files.items():
            try:
                if original is None:
                    path.unlink(missing_ok=True)
                else:
                    path.write_bytes(original)
            except OSError as e:
                problems.append(f"{path}: {e}")
            # the agent's runtime configure leaves its backups beside the file it changed
            for backup in path.parent.glob(f"{path.name}.*"):
                if backup.name.endswith((".bak", ".nodeagent-test")) or ".nodeagent" in backup.name:
                    backup.unlink(missing_ok=True)
        for d, before in self.existing_dirs.items():
            _unmount_below(d, keep=d)
            for entry in d.iterdir() if d.is_dir() else ():
                if entry.name not in before:
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)
                    if entry.exists():
                        problems.append(f"{entry} could not be removed")
        for d in self.created_dirs:
            _unmount_below(d)
            shutil.rmtree(d, ignore_errors=True)
            if d.exists():
                problems.append(f"{d} could not be removed")
        for top in self.cgroups:  # a further node's stop removes them; what a killed run left goes here
            problems += remove_cgroup(top)
        pinned = self.netns_before
        if pinned is not None:
            for entry in NETNS_DIR.glob("cni-*"):
                if entry.name not in pinned:
                    _unmount_below(entry)
                    entry.unlink(missing_ok=True)
        if not problems and self.journal is not None:
            self.journal.unlink(missing_ok=True)
        return problems


def remove_cgroup(top: Path) -> list[str]:
    """Remove a cgroup directory and those below it, deepest first (each must hold no process)."""
    for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            d.rmdir()
    with contextlib.suppress(OSError):
        top.rmdir()
    return [f"cgroup {top} could not be removed"] if top.exists() else []


def undo_interrupted(journal: Path = JOURNAL) -> list[str]:
    """Undo what a cluster whose process ended before its stop did to the host, as its journal says; what was
    undone, in words (empty: no such cluster). A journal of a process still running is refused."""
    if not journal.exists():
        return []
    host, pid, started = _HostChanges.load(journal)
    with contextlib.suppress(psutil.NoSuchProcess):
        if pid != os.getpid() and abs(psutil.Process(pid).create_time() - started) < 1.0:
            raise RuntimeError(f"a test cluster of process {pid} still runs on this host (its journal: {journal})")
    # what the dead run's pods left running (their pause processes and containers, in the kubelets' cgroups:
    # the first node's below /kubepods, the further nodes' below their own cgroups) goes first
    killed = _kill_cgroup_members((*host.pod_cgroups, *{f"/{top.name}" for top in host.cgroups}))
    problems = _remove_cni_nat_rules() + host.undo()
    for d in host.scratch:
        shutil.rmtree(d, ignore_errors=True)
    if problems:
        raise RuntimeError(f"the host changes of an interrupted test cluster ({journal}) could not all be undone: "
                           + "; ".join(problems))
    return [f"undid the host changes of an interrupted test cluster (process {pid}): {len(host.files)} files, "
            f"{len(host.created_nodes)} device nodes, {len(host.iptables)} iptables rules, {len(host.cgroups)} "
            f"cgroups, {killed} processes of its pods"]


def in_memory_cgroup(process: Path, tops: Sequence[str]) -> bool:
    """Whether the process (its /proc directory) is in one of the memory cgroups ``tops`` or below one (False
    when it is gone)."""
    try:
        lines = (process / "cgroup").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "memory" and any(path == t or path.startswith(f"{t}/") for t in tops):
            return True
    return False


def _kill_cgroup_members(tops: Sequence[str]) -> int:
    """SIGKILL every process whose memory cgroup is one of ``tops`` or below one; how many there were."""
    killed = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and in_memory_cgroup(entry, tops):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
    if killed:
        time.sleep(0.5)  # the kernel reaps them before their cgroups can go
    return killed


def _remove_cni_nat_rules() -> list[str]:
    """The bridge plugin's masquerade rules of this cluster's network (POSTROUTING rules commented with its
    name, each jumping to a CNI-* chain): pods killed with containerd never got their CNI DEL."""
    problems: list[str] = []
    rules = _run(["iptables", "-t", "nat", "-S", "POSTROUTING"], check=False).stdout.splitlines()
    for rule in rules:
        if '\\"nodeagent-test\\"' not in rule and '"nodeagent-test"' not in rule:
            continue
        parts = rule.split()
        chain = parts[parts.index("-j") + 1] if "-j" in parts else ""
        delete = subprocess.run(["sh", "-c", f"iptables -t nat {rule.replace('-A ', '-D ', 1)}"],
                                capture_output=True, text=True, check=False)
        if delete.returncode != 0:
            problems.append(f"iptables: {rule}: {delete.stderr.strip()}")
            continue
        if chain.startswith("CNI-"):
            _run(["iptables", "-t", "nat", "-F", chain], check=False)
            _run(["iptables", "-t", "nat", "-X", chain], check=False)
    return problems


def _unmount_below(path: Path, keep: Path | None = None) -> None:
    """Unmount every mount at or below ``path`` (pods' volumes the kubelet left), deepest first; not ``keep``."""
    mounts = []
    with open("/proc/self/mounts", encoding="utf-8") as f:
        for line in f:
            target = line.split()[1].replace("\\040", " ")
            if target == str(path) or target.startswith(f"{path}/"):
                mounts.append(target)
    for target in sorted(mounts, key=len, reverse=True):
        if keep is not None and target == str(keep):
            continue
        _run(["umount", "-l", target], check=False)


@dataclass
class Cluster:
    """A running single-node cluster. ``kubectl(...)`` runs the release's kubectl as cluster admin."""

    apiserver: KubeApiServer
    workdir: Path
    kubectl_bin: Path
    kubelet_bin: Path
    node_name: str
    host_ip: str
    images: dict[str, str]  # role ("agent", "base", "pause") -> image reference of its archive
    imported: tuple[str, ...] = ("pause", "base", "agent")  # the roles whose archives containerd imported
    # another node of the cluster (tests/peers/multinode.py): the command prefix that runs a program in its
    # namespaces, the host directory holding its own copies of the node's host paths, its address, and the
    # kubeconfig its kubelet uses; the defaults are the host's own (the first node)
    enter: tuple[str, ...] = ()
    root: Path | None = None
    node_ip: str = ""
    kubelet_kubeconfig: Path | None = None
    _host: _HostChanges = field(default_factory=_HostChanges, repr=False)
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)
    _logs: list[IO[bytes]] = field(default_factory=list, repr=False)
    _stopping: threading.Event = field(default_factory=threading.Event, repr=False)
    containerd_restarts: int = 0

    # --- commands ---------------------------------------------------------------------------------------
    def kubectl(self, *args: str, check: bool = True, timeout: float = 120.0,
                input_text: str | None = None) -> subprocess.CompletedProcess[str]:
        """``kubectl ARGS`` as cluster admin, from the repository's directory (the README's paths work)."""
        proc = subprocess.run([str(self.kubectl_bin), f"--kubeconfig={self.apiserver.kubeconfig}", *args],
                              capture_output=True, text=True, check=False, timeout=timeout, input=input_text,
                              cwd=REPO)
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def get_json(self, *args: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.kubectl("get", *args, "-o", "json").stdout)
        return out

    def node(self) -> dict[str, Any]:
        return self.get_json("node", self.node_name)

    def ctr(self, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        return _run([*self._ctr_base(), *args], timeout=timeout)

    def _ctr_base(self) -> list[str]:
        return [*self.enter, str(system_binary("ctr", "containerd")), "--address", str(CONTAINERD_SOCKET),
                "--namespace", "k8s.io"]

    def host_path(self, path: Path) -> Path:
        """Where this node's ``path`` (one of its own host paths) lies seen from the host."""
        return path if self.root is None else self.root / path.relative_to("/")

    def wait_for(self, what: str, check: Any, timeout: float = 90.0, poll: float = 0.5) -> Any:
        """Poll ``check()`` until it returns something truthy; fail with ``what`` and the logs' tails."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            self.check_running()
            last = check()
            if last:
                return last
            time.sleep(poll)
        raise AssertionError(f"{what}: not within {timeout:.0f}s (last: {last!r})\n{self.diagnostics()}")

    def log_tail(self, name: str, lines: int = 40) -> str:
        if name in ("kube-apiserver", "etcd"):
            return self.apiserver.log_tail(name, lines)
        return tail(self.workdir / f"{name}.log", lines)

    def diagnostics(self) -> str:
        parts = []
        for name in ("kubelet", "containerd"):
            parts.append(f"--- {name} log tail:\n{self.log_tail(name, 25)}")
        pods = self.kubectl("get", "pods", "-A", "-o", "wide", check=False)
        parts.append(f"--- pods:\n{pods.stdout}{pods.stderr}")
        for pod in self.kubectl("get", "pods", "-n", "nodeagent", "-o", "name", check=False).stdout.split():
            for container in ("bootstrap", "nodeagent"):
                for previous in ("--previous=false", "--previous=true"):
                    out = self.kubectl("logs", "-n", "nodeagent", pod, "-c", container, previous, "--tail=200",
                                       check=False)
                    if out.stdout.strip():
                        parts.append(f"--- {pod} {container} {previous}:\n{out.stdout}")
        return "\n".join(parts)

    def check_running(self) -> None:
        for name, proc in self._procs.items():
            if name != "containerd" and proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    # --- processes --------------------------------------------------------------------------------------
    def _spawn(self, name: str, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        log = (self.workdir / f"{name}.log").open("ab")
        self._logs.append(log)
        self._procs[name] = subprocess.Popen([*self.enter, *args], stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _supervise_containerd(self, args: Sequence[str], env: dict[str, str]) -> None:
        """containerd as a supervisor (systemd's Restart=always) keeps it: started again whenever it exits."""
        self._spawn("containerd", args, env)
        while not self._stopping.is_set():
            proc = self._procs["containerd"]
            if proc.poll() is not None and not self._stopping.is_set():
                time.sleep(0.5)
                if self._stopping.is_set():
                    break
                self.containerd_restarts += 1
                self._spawn("containerd", args, env)
            self._stopping.wait(0.2)

    def start_kubelet(self) -> None:
        self._spawn("kubelet", [
            str(self.kubelet_bin), f"--config={self.workdir / 'kubelet.yaml'}",
            f"--kubeconfig={self.kubelet_kubeconfig or self.apiserver.kubeconfig}",
            f"--hostname-override={self.node_name}", f"--node-ip={self.node_ip or self.host_ip}",
            f"--root-dir={KUBELET_DIR}", "--v=2",
        ])

    def stop_kubelet(self) -> None:
        proc = self._procs.pop("kubelet", None)
        if proc is not None:
            stop_process(proc, timeout=20)

    def restart_kubelet(self) -> None:
        self.stop_kubelet()
        self.start_kubelet()

    def stop_node(self) -> None:
        """Stop the node's kubelet, the containers of its containerd, then its other processes."""
        self._stopping.set()
        self.stop_kubelet()
        # the pods' containers and sandboxes go with containerd's task shims
        with contextlib.suppress(Exception):
            _stop_all_containers(self._ctr_base())
        for name in list(self._procs):
            stop_process(self._procs.pop(name), timeout=20)
        for f in self._logs:
            f.close()
        self._logs.clear()

    def stop(self) -> list[str]:
        """Stop everything, undo the host changes; the problems found while cleaning (empty: clean)."""
        self._stopping.set()
        problems: list[str] = []
        with contextlib.suppress(Exception):
            self.kubectl("delete", "pods", "--all", "-A", "--grace-period=0", "--force", "--wait=false",
                         check=False, timeout=30)
        self.stop_node()
        self.apiserver.stop()
        _run(["ip", "link", "delete", BRIDGE], check=False)
        problems += _remove_cni_nat_rules()
        problems += self._host.undo()
        return problems


def _stop_all_containers(base: list[str]) -> None:
    """Kill what a node's containerd (``base``: its ``ctr`` command) still runs (shims and their runc
    containers) before it stops."""
    tasks = _run([*base, "tasks", "list", "-q"], check=False, timeout=30).stdout.split()
    for task in tasks:
        _run([*base, "tasks", "kill", "-s", "SIGKILL", task], check=False, timeout=30)
    for task in tasks:
        _run([*base, "tasks", "delete", "-f", task], check=False, timeout=30)


def _kubelet_config(healthz_port: int, port: int, cgroup_root: str | None = None) -> str:
    config: dict[str, Any] = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs",
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
        "address": "0.0.0.0",
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "failSwapOn": False,
        "failCgroupV1": False,
        "resolvConf": "/etc/resolv.conf",
        "maxPods": 30,
        "serializeImagePulls": False,
        # a shared CI disk: never evict or garbage-collect the imported images for want of space
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "nodeStatusUpdateFrequency": "4s",
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
    }
    if cgroup_root is not None:  # a node beside others on this machine: its pods' cgroups under its own
        config["cgroupRoot"] = cgroup_root
    return json.dumps(config, indent=1)


def _containerd_config(root: Path, pause_ref: str, cni_conf_dir: Path, cni_bin_dir: str, runc: Path,
                       netns_dir: str | None = None) -> str:
    # the pods' network namespaces are mounted under /var/run/netns unless ``netns_dir`` says otherwise
    netns = "" if netns_dir is None else f'  netns_mounts_under = "{netns_dir}"\n'

    return f"""# containerd of the nodeagent test cluster (tests/peers/cluster.py); the host's file comes back after
version = 3
root = "{root}"
state = "/run/containerd"

[grpc]
  address = "{CONTAINERD_SOCKET}"

[ttrpc]
  address = "{CONTAINERD_SOCKET}.ttrpc"

[plugins."io.containerd.cri.v1.images".pinned_images]
  sandbox = "{pause_ref}"

[plugins."io.containerd.cri.v1.runtime"]
{netns}  enable_cdi = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]

[plugins."io.containerd.cri.v1.runtime".containerd]
  default_runtime_name = "runc"

[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
  BinaryName = "{runc}"
  SystemdCgroup = false

[plugins."io.containerd.cri.v1.runtime".cni]
  bin_dirs = ["{cni_bin_dir}"]
  conf_dir = "{cni_conf_dir}"

[plugins."io.containerd.nri.v1.nri"]
  disable = true
"""


# The driver's MPS control program, as the simulator's stand-in (nodeagent/simulator/mps_control.py). It is a
# Python module, so it needs an interpreter with nodeagent: the one program that runs it is the agent, in its
# own container, so the agent image's interpreter. It works on the simulated machine the stand-in NVML names
# (its state found from where the script lies, as the node's /host/usr/bin/.. in the container), so its
# server shows as a process on its GPUs and a compute mode MPS cannot use is refused, as the real one does.
MPS_CONTROL_STAND_IN = """#!/bin/sh
# nvidia-cuda-mps-control of the nodeagent test cluster (tests/peers/cluster.py): the simulator's stand-in
root=$(cd "$(dirname "$0")/../.." && pwd)
export NODEAGENT_SIM_MACHINE={machine} NODEAGENT_SIM_STATE="${{root%/}}{state}"
exec /opt/nodeagent/bin/python -m nodeagent.simulator.mps_control "$@"
"""

# The driver's nvidia-smi as the simulator's stand-in (nodeagent/simulator/abi/smi.py: GPU resets only), run by the
# agent from its container as the node's /host/usr/bin/nvidia-smi for a remediation's reset; it resets the
# simulated GPUs in the node's state file, found the same way as the MPS stand-in finds it.
SMI_STAND_IN = """#!/bin/sh
# nvidia-smi of the nodeagent test cluster (tests/peers/cluster.py): the simulator's stand-in (resets only)
root=$(cd "$(dirname "$0")/../.." && pwd)
export NODEAGENT_SIM_MACHINE={machine} NODEAGENT_SIM_STATE="${{root%/}}{state}"
exec /opt/nodeagent/bin/python -m nodeagent.simulator.abi.smi "$@"
"""

# nvidia-imex and nvidia-imex-ctl of the test cluster: the simulator's stand-ins (they talk TCP to each other)
IMEX_STAND_IN = """#!/bin/sh
# {program} of the nodeagent test cluster (tests/peers/cluster.py): the simulator's stand-in
exec /opt/nodeagent/bin/python -m nodeagent.simulator.{module} "$@"
"""

CAP_SYS_RESOURCE = 24
RUNC_WRAPPER = """#!/bin/sh
# runc for the nodeagent test cluster: this host's root lacks CAP_SYS_RESOURCE, so a negative oom_score_adj
# (the kubelet's -998 for sandboxes, -997 for critical pods) cannot be set; 0 instead (tests/peers/cluster.py)
bundle=
prev=
for arg in "$@"; do
  [ "$prev" = "--bundle" ] && bundle=$arg
  prev=$arg
done
if [ -n "$bundle" ] && [ -f "$bundle/config.json" ]; then
  sed -i 's/"oomScoreAdj":-[0-9]*/"oomScoreAdj":0/' "$bundle/config.json"
fi
exec {runc} "$@"
"""


def _has_capability(bit: int) -> bool:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def _cni_conflist(ipam_dir: Path, subnet: str = POD_SUBNET) -> str:
    return json.dumps({
        "cniVersion": "1.0.0",
        "name": "nodeagent-test",
        "plugins": [{
            "type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True, "hairpinMode": True,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": subnet}]],
                     "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(ipam_dir)},
        }],
    }, indent=1)


def _device_nodes(host: _HostChanges) -> None:
    nodes = {f"/dev/nvidia{i}": (NVIDIA_MAJOR, i) for i in range(GPU_COUNT)}
    nodes.update({"/dev/nvidiactl": (NVIDIA_MAJOR, 255), "/dev/nvidia-modeset": (NVIDIA_MAJOR, 254),
                  "/dev/nvidia-uvm": (UVM_MAJOR, 0), "/dev/nvidia-uvm-tools": (UVM_MAJOR, 1)})
    for path, (major, minor) in nodes.items():
        p = Path(path)
        if p.exists():
            raise RuntimeError(f"{p} exists already on this host: the test cluster makes its own GPU device nodes")
        host.make_node(p, major, minor)


def _served(path: Path) -> bool:
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def _check_free() -> None:
    """The host paths a kubelet and containerd own must be free: one cluster at a time on a machine."""
    for path, who in ((CONTAINERD_SOCKET, "a containerd"), (KUBELET_DIR / "device-plugins" / "kubelet.sock",
                                                          "a kubelet")):
        if _served(path):
            raise RuntimeError(f"{who} already serves {path}: the test cluster needs it")


def _import_image(ctr_base: list[str], archive: str, ref: str) -> None:
    proc = _run([*ctr_base, "images", "import", archive], check=False, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"ctr images import {archive} failed: {proc.stderr.strip()}")
    listed = _run([*ctr_base, "images", "list", "-q"], timeout=60).stdout.split()
    if ref not in listed:
        raise RuntimeError(f"{archive} imported, but containerd lists no image {ref} (it lists {listed})")


@dataclass(frozen=True)
class NodePeers:
    """The programs and image archives every node of a test cluster runs from (tests/testbin/setup.sh)."""

    kubelet: Path
    kubectl: Path
    containerd: Path
    shim: Path
    runc: Path
    library: str
    cni_bin: str
    images: dict[str, tuple[str, str]]  # role -> (archive, reference)


def node_peers() -> NodePeers:
    """The node's peers, or PeerMissingError naming what the setup has not built."""
    for tool in ("iptables", "ip", "ctr"):
        system_binary(tool, {"ip": "iproute2", "ctr": "containerd"}.get(tool, tool))
    peers = NodePeers(
        kubelet=peer_binary("NODEAGENT_KUBELET", "nodeagent_peers_kubelet", "kubelet v1.34"),
        kubectl=peer_binary("NODEAGENT_KUBECTL", "nodeagent_peers_kubelet", "kubectl v1.34"),
        containerd=peer_binary("NODEAGENT_CONTAINERD2", "nodeagent_peers_containerd2", "containerd 2"),
        shim=peer_binary("NODEAGENT_CONTAINERD2_SHIM", "nodeagent_peers_cdi_check", "containerd 2's runc shim"),
        runc=peer_binary("NODEAGENT_RUNC", "nodeagent_peers_containerd", "runc (Debian)"),
        library=os.environ.get("NODEAGENT_NVML_LIBRARY", ""),
        cni_bin=os.environ.get("NODEAGENT_CNI_BIN_DIR", ""),
        images={role: (os.environ.get(f"NODEAGENT_{var}", ""), os.environ.get(f"NODEAGENT_{var}_REF", ""))
                for role, var in (("pause", "PAUSE_IMAGE"), ("base", "BASE_IMAGE"), ("agent", "AGENT_IMAGE"))})
    missing = [name for name, ok in (
        ("NODEAGENT_NVML_LIBRARY", Path(peers.library).is_file()),
        ("NODEAGENT_CNI_BIN_DIR", Path(peers.cni_bin, "bridge").is_file()),
        *((f"the {role} image archive", Path(a).is_file() and bool(r)) for role, (a, r) in peers.images.items()))
        if not ok]
    if missing:
        raise PeerMissingError(f"the test cluster needs {', '.join(missing)}: run `bash tests/testbin/setup.sh` "
                               "(steps kubelet, CNI plugins, images) and source it")
    return peers


def start_cluster(imported: Sequence[str] = ("pause", "base", "agent")) -> Cluster:
    """The cluster, its containerd holding the images of the roles ``imported`` (the pause image always: the
    kubelet's sandboxes use it)."""
    if "pause" not in imported or not set(imported) <= {"pause", "base", "agent"}:
        raise ValueError(f"imported images: {imported!r} (roles pause, base, agent; pause among them)")
    peers = node_peers()
    _check_free()
    for done in undo_interrupted():
        print(done)
    host_ip = _host_ip()
    workdir = Path(tempfile.mkdtemp(prefix="nodeagent-cluster-"))
    host = _HostChanges(journal=JOURNAL, scratch=[workdir], pod_cgroups=["/kubepods"])
    server: KubeApiServer | None = None
    cluster: Cluster | None = None
    try:
        host.own_dirs()
        server = start_apiserver(
            feature_gates="DRADeviceTaints=true,DRAExtendedResource=true",
            extra_args=("--runtime-config=resource.k8s.io/v1alpha3=true",
                        "--kubelet-preferred-address-types=InternalIP"),
            bind_address="0.0.0.0", advertise_address=host_ip, service_accounts=True)
        host.add_scratch(server.workdir)
        cluster = Cluster(apiserver=server, workdir=workdir, kubectl_bin=peers.kubectl, kubelet_bin=peers.kubelet,
                          node_name=NODE_NAME, host_ip=host_ip,
                          images={role: ref for role, (_, ref) in peers.images.items()}, imported=tuple(imported),
                          _host=host)
        api_port = server.url.rsplit(":", 1)[1]
        # the `kubernetes` Service for pods (and, as kube-proxy routes it, for the host's own network: pods with
        # hostNetwork), as kube-proxy would route it
        for chain in ("PREROUTING", "OUTPUT"):
            rule = [chain, "-d", f"{SERVICE_IP}/32", "-p", "tcp", "--dport", "443", "-j", "DNAT",
                    "--to-destination", f"{host_ip}:{api_port}", "-m", "comment", "--comment",
                    "nodeagent-test-cluster"]
            host.add_rule(rule)
        _start_control_plane(cluster)
        # GPUs: device nodes, the stand-in driver library and its machine, the state on the host
        _device_nodes(host)
        host.write(DRIVER_DIR / "libnvidia-ml.so.1", Path(peers.library).read_bytes(), 0o755)
        for program in (MPS_CONTROL, NVIDIA_SMI, IMEX_DAEMON, IMEX_CTL):
            if program.exists():
                raise RuntimeError(f"{program} exists already on this host: the test cluster installs its stand-in")
        write_machine(host.write, MACHINE)
        start_node_runtime(cluster, peers, host.write)
    except BaseException:
        if cluster is not None:
            cluster.stop()
        else:
            if server is not None:
                server.stop()
            host.undo()
        if server is not None:
            shutil.rmtree(server.workdir, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return cluster


FileWriter = Callable[[Path, bytes, int], None]  # (a node's host path, its content, its mode)


def write_machine(write: FileWriter, machine: str) -> None:
    """The node's simulated GPUs: the stand-in library's machine and state file beside the driver library, the
    driver's MPS control program as the simulator's stand-in working on that machine, the IMEX daemon and its
    query tool as the simulator's stand-ins."""
    state_rel = os.path.relpath(SIM_STATE, DRIVER_DIR)
    write(DRIVER_DIR / "nodeagent-sim.conf",
          f"# the nodeagent test cluster's simulated GPUs (tests/peers/cluster.py)\n"
          f"machine = {machine}\nstate = {state_rel}\n".encode(), 0o644)
    write(MPS_CONTROL, MPS_CONTROL_STAND_IN.format(machine=machine, state=SIM_STATE).encode(), 0o755)
    write(NVIDIA_SMI, SMI_STAND_IN.format(machine=machine, state=SIM_STATE).encode(), 0o755)
    for program, module in ((IMEX_DAEMON, "imex_daemon"), (IMEX_CTL, "imex_ctl")):
        write(program, IMEX_STAND_IN.format(program=program.name, module=module).encode(), 0o755)


def start_node_runtime(cluster: Cluster, peers: NodePeers, write: FileWriter, *, subnet: str = POD_SUBNET,
                       cgroup_root: str | None = None, netns_dir: str | None = None) -> None:
    """A node's containerd (supervised, its images imported), CNI bridge network ``subnet`` and kubelet, up to
    the Node Ready and the default service account; ``write`` puts a file on the node's host paths."""
    workdir = cluster.workdir
    cluster.host_path(SIM_STATE).parent.mkdir(parents=True, exist_ok=True)
    bindir = workdir / "bin"
    bindir.mkdir()
    (bindir / "containerd").symlink_to(peers.containerd)
    (bindir / "containerd-shim-runc-v2").symlink_to(peers.shim)
    runc = peers.runc
    if not _has_capability(CAP_SYS_RESOURCE):
        wrapper = bindir / "runc"
        wrapper.write_text(RUNC_WRAPPER.replace("{runc}", str(runc)))
        wrapper.chmod(0o755)
        runc = wrapper
    cni_conf = workdir / "cni"
    cni_conf.mkdir()
    (cni_conf / "10-nodeagent-test.conflist").write_text(_cni_conflist(workdir / "cni-ipam", subnet))
    write(CONTAINERD_CONFIG, _containerd_config(workdir / "containerd", peers.images["pause"][1], cni_conf,
                                                peers.cni_bin, runc, netns_dir).encode(), 0o644)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"}
    threading.Thread(target=cluster._supervise_containerd,
                     args=([str(bindir / "containerd"), f"--config={CONTAINERD_CONFIG}"], env),
                     name=f"containerd-supervisor-{cluster.node_name}", daemon=True).start()
    cluster.wait_for("containerd answers", cluster.host_path(CONTAINERD_SOCKET).exists, timeout=60)
    cluster.wait_for("containerd serves its API",
                     lambda: _run([*cluster._ctr_base(), "version"], check=False).returncode == 0, timeout=60)
    for role, (archive, ref) in peers.images.items():
        if role in cluster.imported:
            _import_image(cluster._ctr_base(), archive, ref)
    (workdir / "kubelet.yaml").write_text(_kubelet_config(free_port(), free_port(), cgroup_root))
    cluster.start_kubelet()
    cluster.wait_for(f"Node {cluster.node_name} Ready", lambda: node_ready(cluster), timeout=READY_TIMEOUT)
    cluster.wait_for("the default service account", lambda: cluster.kubectl(
        "get", "serviceaccount", "default", check=False).returncode == 0, timeout=60)


def _start_control_plane(cluster: Cluster) -> None:
    from tests.peers.controlplane import RELEASES

    release = RELEASES[0]
    kubeconfig = cluster.apiserver.kubeconfig
    pki = cluster.apiserver.workdir / "pki"
    gates = f"--feature-gates={release.feature_gates}"
    common = [f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
              f"--authorization-kubeconfig={kubeconfig}", "--bind-address=127.0.0.1", "--leader-elect=false", "--v=1",
              gates]
    cluster._spawn("kube-controller-manager", [
        str(release.controller_manager()), *common, f"--secure-port={free_port()}",
        f"--cert-dir={cluster.workdir / 'kube-controller-manager'}",
        "--controllers=*", "--use-service-account-credentials=false", f"--root-ca-file={pki / 'ca.crt'}",
        f"--service-account-private-key-file={pki / 'sa.key'}", "--concurrent-gc-syncs=5"])
    cluster._spawn("kube-scheduler", [
        str(release.scheduler()), *common, f"--secure-port={free_port()}",
        f"--cert-dir={cluster.workdir / 'kube-scheduler'}"])


def node_ready(cluster: Cluster) -> bool:
    proc = cluster.kubectl("get", "node", cluster.node_name, "-o", "json", check=False)
    if proc.returncode != 0:
        return False
    conditions = json.loads(proc.stdout).get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


@contextlib.contextmanager
def running_cluster(imported: Sequence[str] = ("pause", "base", "agent")) -> Iterator[Cluster]:
    cluster = start_cluster(imported)
    try:
        yield cluster
    finally:
        problems = cluster.stop()
        shutil.rmtree(cluster.apiserver.workdir, ignore_errors=True)
        shutil.rmtree(cluster.workdir, ignore_errors=True)
        if problems:
            raise RuntimeError("the test cluster did not leave the host clean: " + "; ".join(problems))


__all__ = ["Cluster", "running_cluster", "start_cluster", "undo_interrupted"]
