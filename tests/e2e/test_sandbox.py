"""A sandbox is a sandbox: every command run with the simulator or with ``--root`` is traced with strace
(file system calls and execve, all threads and children) and nothing may be written, executed, or (under
``--root``) looked up outside the sandbox.

"Outside" is judged by path: a write is any open with O_WRONLY/O_RDWR/O_CREAT/O_TRUNC or any call that
makes, removes, renames, links or changes a file; Python's own byte-code cache (``__pycache__``) and the
terminal/null devices are the only allowed writes outside. Reads of the interpreter's own files are fine;
reads of the host places nodeagent works on (containerd, the kubelet, CDI, NVIDIA devices, /sys, /run...)
outside the sandbox are not.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.e2e._agent import REPO

NODEAGENT = [sys.executable, "-m", "nodeagent"]

WRITE_CALLS = {
    "mkdir",
    "mkdirat",
    "unlink",
    "unlinkat",
    "rmdir",
    "rename",
    "renameat",
    "renameat2",
    "link",
    "linkat",
    "symlink",
    "symlinkat",
    "chmod",
    "fchmodat",
    "fchmodat2",
    "chown",
    "lchown",
    "fchownat",
    "truncate",
    "utime",
    "utimes",
    "utimensat",
    "futimesat",
    "mknod",
    "mknodat",
    "setxattr",
    "lsetxattr",
    "removexattr",
}
OPEN_CALLS = {"open", "openat", "openat2", "creat"}
WRITE_FLAGS = re.compile(r"\bO_(WRONLY|RDWR|CREAT|TRUNC)\b")
# Host places nodeagent reads or writes on a real node: none may be touched outside the sandbox.
HOST_AREAS = (
    "/etc/containerd",
    "/etc/nvidia-container-runtime",
    "/etc/nodeagent",
    "/etc/cdi",
    "/var/run/cdi",
    "/run/cdi",
    "/var/lib/kubelet",
    "/var/lib/nodeagent",
    "/run/nodeagent",
    "/var/run/nodeagent",
    "/run/containerd",
    "/var/run/containerd",
    "/sys/bus/pci",
    "/sys/fs/cgroup",
    "/sys/module/nvidia",
    "/dev/nvidia",
    "/proc/devices",
    "/proc/driver/nvidia",
    "/usr/bin/containerd",
    "/usr/local/bin/containerd",
    "/usr/sbin/containerd",
    "/run/systemd",
    "/usr/bin/nvidia",
    "/usr/lib/x86_64-linux-gnu/libnvidia",
    "/var/lib/dpkg",
)
ALLOWED_WRITES = ("/dev/null", "/dev/tty", "/dev/pts/")
LINE = re.compile(r"^(?:\[pid\s+)?(\d+)\]?\s+(\w+)\((.*)\)\s+=\s+(-?\d+|\?)")
PATH_ARG = re.compile(r'(?:(\d+|AT_FDCWD)<([^>]*)>|AT_FDCWD),\s+"((?:[^"\\]|\\.)*)"|^"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Access:
    call: str
    path: str
    write: bool
    line: str


def _accesses(log: Path, cwd: Path) -> Iterator[Access]:
    for raw in log.read_text(errors="replace").splitlines():
        m = LINE.match(raw)
        if m is None:
            continue
        call, args = m.group(2), m.group(3)
        p = PATH_ARG.search(args)
        if p is None:
            continue
        base = p.group(2) if p.group(2) is not None else str(cwd)
        name = p.group(3) if p.group(3) is not None else p.group(4)
        path = os.path.normpath(os.path.join(base, name)) if name else base
        write = call in WRITE_CALLS or (call in OPEN_CALLS and bool(WRITE_FLAGS.search(args)))
        if call not in {"symlink", "symlinkat"}:  # a symlink's first argument is its text, not a path used
            yield Access(call, path, write, raw)
        if call in {"rename", "renameat", "renameat2", "link", "linkat", "symlink", "symlinkat"}:
            rest = args[p.end() :]
            second = PATH_ARG.search(rest.lstrip(", "))
            if second is not None:
                b2 = second.group(2) if second.group(2) is not None else str(cwd)
                n2 = second.group(3) if second.group(3) is not None else second.group(4)
                if n2:
                    yield Access(call, os.path.normpath(os.path.join(b2, n2)), True, raw)


def _inside(path: str, roots: tuple[Path, ...]) -> bool:
    return any(path == str(r) or path.startswith(str(r) + "/") for r in roots)


@pytest.fixture(scope="module")
def strace() -> str:
    found = shutil.which("strace")
    if found is None:
        pytest.fail(
            "strace is missing: apt-get install strace (tests/testbin/setup.sh installs it)", pytrace=False
        )
    return found


@dataclass
class Sandbox:
    tmp: Path  # the test's directory (the cwd): sandboxes, state files and the user's home are below it
    env: dict[str, str]
    strace: str
    output: str = ""  # standard output and error of the last traced command

    def traced(
        self,
        *args: str,
        long_running: str | None = None,
        said: str | None = None,
        expect: int | None = 0,
        program: tuple[str, ...] = tuple(NODEAGENT),
    ) -> list[Access]:
        """Run ``nodeagent ARGS`` under strace; ``long_running``: a path (relative to the cwd) whose
        appearance means the daemon is up (and, with ``said``, once its output holds that text), then it is
        stopped with SIGINT."""
        log = self.tmp / "strace.log"
        cmd = [
            self.strace,
            "-f",
            "-qq",
            "-y",
            "-s",
            "4096",
            "-e",
            "trace=%file,execve",
            "-o",
            str(log),
            *program,
            *args,
        ]
        if long_running is None:
            proc = subprocess.run(
                cmd, cwd=self.tmp, env=self.env, capture_output=True, text=True, timeout=120, check=False
            )
            out, err, rc = proc.stdout, proc.stderr, proc.returncode
            self.output = out + err
        else:
            out_file, err_file = self.tmp / "daemon.out", self.tmp / "daemon.err"
            with out_file.open("w") as stdout, err_file.open("w") as stderr:
                popen = subprocess.Popen(cmd, cwd=self.tmp, env=self.env, stdout=stdout, stderr=stderr, text=True)

            def ready() -> bool:
                if not (self.tmp / long_running).exists():
                    return False
                return said is None or said in out_file.read_text() + err_file.read_text()

            deadline = time.monotonic() + 60
            while not ready() and time.monotonic() < deadline:
                if popen.poll() is not None:
                    break
                time.sleep(0.2)
            up = (self.tmp / long_running).exists()
            for child in psutil.Process(popen.pid).children():  # the agent, not strace (which would detach)
                child.send_signal(signal.SIGINT)
            popen.wait(timeout=60)
            rc = popen.returncode
            out, err = out_file.read_text(), err_file.read_text()
            out_file.unlink()
            err_file.unlink()
            self.output = out + err
            assert up, f"{args}: {long_running} never appeared\n{err[-3000:]}"
        if expect is not None:
            assert rc == expect, f"nodeagent {' '.join(args)} exited {rc}\n{out[-2000:]}\n{err[-3000:]}"
        assert "Traceback" not in err, err[-3000:]
        return list(_accesses(log, self.tmp))

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``nodeagent ARGS`` from the test's directory, not traced."""
        return subprocess.run(
            [*NODEAGENT, *args],
            cwd=self.tmp,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def untouched(self, accesses: list[Access], outside: Path) -> None:
        """Nothing under ``outside`` was opened, listed, looked up, written or executed."""
        seen = [a.line for a in accesses if _inside(a.path, (outside.resolve(),))]
        assert not seen, "\n".join(["reached out of the root:", *seen[:40]])

    def check(self, accesses: list[Access], sandbox: Path, *, active: bool = True) -> None:
        allowed = (sandbox.resolve(), self.tmp.resolve())
        bad: list[str] = []
        execs = [a for a in accesses if a.call == "execve"]
        # the interpreter started by strace (and nothing else: no systemctl, no containerd, no shell)
        for a in execs:
            if not (a.path == sys.executable or a.path == os.path.realpath(sys.executable)):
                bad.append(f"executed: {a.line}")
        for a in accesses:
            if a.call == "execve":
                continue
            if (
                a.write
                and not _inside(a.path, allowed)
                and "/__pycache__" not in a.path  # the interpreter's byte-code cache (the directory too)
                and not a.path.startswith(ALLOWED_WRITES)
            ):
                bad.append(f"wrote outside: {a.line}")
            elif not _inside(a.path, allowed) and any(
                a.path == h or a.path.startswith(h + "/") or (a.path.startswith(h) and h.endswith("nvidia"))
                for h in HOST_AREAS
            ):
                bad.append(f"touched a host path: {a.line}")
        assert not bad, "\n".join(bad[:40])
        if active:
            assert any(_inside(a.path, (sandbox.resolve(),)) for a in accesses), (
                "nothing happened in the sandbox"
            )


@pytest.fixture
def box(strace: str) -> Iterator[Sandbox]:
    # short: the sandboxes hold Unix sockets (107 bytes at most for their paths)
    tmp_path = Path(tempfile.mkdtemp(prefix="nasb-", dir="/tmp"))
    try:
        yield _box(tmp_path, strace)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _box(tmp_path: Path, strace: str) -> Sandbox:
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NODEAGENT_", "KUBERNETES_", "XDG_"))}
    env.update(
        HOME=str(home), XDG_RUNTIME_DIR=str(tmp_path / "xdg"), PYTHONPATH=str(REPO), KUBECONFIG="/nonexistent"
    )
    (tmp_path / "xdg").mkdir(mode=0o700)
    return Sandbox(tmp_path, env, strace)


@pytest.fixture
def outside() -> Iterator[Path]:
    """A directory out of every sandbox (not under the test's directory, which ``check`` allows)."""
    d = Path(tempfile.mkdtemp(prefix="nasb-out-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _up(root: Path) -> str:
    """A relative ``../`` chain from anywhere below ``root`` to ``/`` (more than enough ``..``)."""
    return "/".join([".."] * (len(root.resolve().parts) + 6))


def plant_links(root: Path, outside: Path) -> dict[Path, bytes]:
    """The attack run's links out of ``root`` (absolute ones and a ``../`` chain), each to something in
    ``outside``; returns what ``outside`` holds, which must stay as it is."""
    (outside / "lib").mkdir()
    (outside / "lib/libcuda.so.550.54.15").write_text("the host's library\n")
    (outside / "mig-state.json").write_text('{"phase": "outside"}\n')
    (outside / "checkpoint").write_text('{"Data": {"RegisteredDevices": {"nvidia.com/gpu": ["outside"]}}}\n')
    (outside / "planes.json").write_text('{"outside": true}\n')
    links = {
        "usr/lib/x86_64-linux-gnu": str(outside / "lib"),
        "var/lib/nodeagent/mig/mig-state.json": f"{_up(root)}{outside}/mig-state.json",
        "var/lib/kubelet/device-plugins/kubelet_internal_checkpoint": str(outside / "checkpoint"),
        "var/lib/nodeagent/planes.json": str(outside / "planes.json"),
    }
    for name, target in links.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(target)
    return {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}


def unchanged(outside: Path, before: dict[Path, bytes]) -> None:
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before


# the README's quick start, without the metrics listener (tests run in parallel with other agents)
DEMO_RUN = ("--root", "./demo", "run", "--simulate", "dgx-h100", "--no-kube", "--metrics-address", "")
DEMO_SOCKET = "demo/var/lib/kubelet/device-plugins/nvidia-gpu.sock"


def _default_sandbox(box: Sandbox, machine: str) -> Path:
    return box.tmp / "xdg" / "nodeagent-sim" / machine


def test_readme_quick_start_commands_stay_in_their_sandboxes(box: Sandbox, outside: Path) -> None:
    """The README's commands, in a demo root where links out of it were planted (the driver's library
    directory, the kubelet's checkpoint, the planes ledger, the MIG state): ``run`` and ``bootstrap`` list,
    read and write inside the root only."""
    demo = box.tmp / "demo"
    before = plant_links(demo, outside)
    accesses = box.traced(*DEMO_RUN, long_running=DEMO_SOCKET)
    box.check(accesses, demo)
    box.untouched(accesses, outside)
    box.check(
        box.traced("discover", "--simulate", "dgx-h100", "--topology"), _default_sandbox(box, "dgx-h100")
    )
    accesses = box.traced("--root", "./demo", "bootstrap", "--simulate", "dgx-h100", "--no-kube")
    box.check(accesses, demo)
    box.untouched(accesses, outside)
    unchanged(outside, before)
    box.check(
        box.traced("mig", "plan", "--simulate", "dgx-a100-80gb", "-c", "all-balanced"),
        _default_sandbox(box, "dgx-a100-80gb"),
    )


def test_simulator_without_root_gets_a_default_sandbox(box: Sandbox, outside: Path) -> None:
    """The default sandbox is a root like any other (links in it are followed inside it); it is named by
    the state file when one is given, else by the machine (that it keeps the machine's state between commands:
    tests/unit/test_mig_cli.py)."""
    sandbox = _default_sandbox(box, "dgx-h100")
    before = plant_links(sandbox, outside)
    box.check(
        box.traced(
            "run",
            "--simulate",
            "dgx-h100",
            "--no-kube",
            "--metrics-address",
            "",
            long_running=str(sandbox / "var/lib/kubelet/device-plugins/nvidia-gpu.sock"),
        ),
        sandbox,
    )
    accesses = box.traced("cdi", "generate", "--simulate", "dgx-h100", "--sim-host-files")
    box.check(accesses, sandbox)
    box.untouched(accesses, outside)
    assert (sandbox / "var/run/cdi/nvidia.yaml").is_file()
    assert (sandbox / str(outside).lstrip("/") / "lib/libcuda.so.1").is_symlink()  # the driver, inside
    box.check(box.traced("cdi", "show", "--simulate", "dgx-h100", "--check"), sandbox)
    box.check(box.traced("cdi", "generate", "--simulate", "dgx-h100", "--stdout"), sandbox)
    a100 = _default_sandbox(box, "state-a100")  # the state file names it, --simulate repeated or not
    (a100 / "var/lib/nodeagent/mig").mkdir(parents=True)
    (a100 / "var/lib/nodeagent/mig/mig-state.json").symlink_to(f"{_up(a100)}{outside}/mig-state.json")
    for args in (
        ("mig", "apply", "--simulate", "dgx-a100-80gb", "-c", "all-1g.10gb"),
        ("mig", "assert", "-c", "all-1g.10gb"),
        ("mig", "plan", "--simulate", "dgx-a100-80gb", "-c", "all-disabled"),
    ):
        accesses = box.traced(*args, "--sim-state", "a100.json")
        box.check(accesses, a100)
        box.untouched(accesses, outside)
    assert (a100 / str(outside).lstrip("/") / "mig-state.json").is_file()  # the ../ chain stopped at the root
    box.check(box.traced("bootstrap", "--simulate", "dgx-h100", "--no-kube"), sandbox)
    unchanged(outside, before)


def test_sim_subcommands_touch_only_their_state_file(box: Sandbox) -> None:
    box.check(box.traced("sim", "machines"), box.tmp, active=False)
    for args in (
        ("sim", "show", "--simulate", "dgx-h100", "--sim-state", "s.json"),
        ("sim", "inject", "xid", "--sim-state", "s.json", "--gpu", "0", "--code", "79"),
        ("sim", "reboot", "--sim-state", "s.json"),
    ):
        box.check(box.traced(*args), box.tmp)
    assert (box.tmp / "s.json").is_file()
    assert not list(box.tmp.glob("*.lock")), sorted(box.tmp.iterdir())  # the state's lock leaves no file
    assert not (box.tmp / "xdg" / "nodeagent-sim").exists()  # no host path was needed: no sandbox made


def test_root_never_acts_on_the_host(box: Sandbox, outside: Path) -> None:
    """``--root R`` other than /: no restart, no exec of R's binaries, nothing read outside R (links out of
    it are followed inside it)."""
    root = box.tmp / "r"
    before = plant_links(root, outside)
    (root / "etc/containerd").mkdir(parents=True)
    (root / "etc/containerd/config.toml").write_text('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n')
    marker = box.tmp / "ran"
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/containerd").write_text(f"#!/bin/sh\ntouch {marker}\n")
    (root / "usr/bin/containerd").chmod(0o755)
    secrets = box.tmp / "secrets"
    secrets.mkdir()
    (secrets / "secret").write_text("{{ .NotForYou }}\n")
    (root / "etc/containerd/config.toml.tmpl").symlink_to(secrets / "secret")
    (root / "lib/systemd/system").mkdir(parents=True)  # doctor: neither systemctl nor containerd is run under R
    (root / "lib/systemd/system/nodeagent.service").write_text("[Service]\nExecStart=/usr/bin/nodeagent run\n")
    accesses = box.traced("--root", "r", "doctor", "--simulate", "t4x1", "--no-kube", expect=1)
    box.check(accesses, root)
    box.untouched(accesses, outside)
    assert "not checked under --root" in box.output and "read by nodeagent only" in box.output, box.output
    for args in (
        ("runtime", "configure", "--dry-run"),
        ("runtime", "show"),
        ("runtime", "configure"),
        ("runtime", "show", "--json"),
        ("runtime", "unconfigure"),
    ):
        box.check(box.traced("--root", "r", *args), root)
    assert not marker.exists()
    unchanged(outside, before)
    r = box.run("--root", "r", "runtime", "configure", "--restart", "systemd")
    assert r.returncode == 2 and "--restart systemd restarts this host's containerd" in r.stderr, r.stderr


def test_root_slash_with_the_simulator_is_refused(box: Sandbox) -> None:
    """... and so is a state file out of the root (nodeagent writes it: a file of the simulated node)."""
    for args in (
        ("--root", "/", "run", "--simulate", "dgx-h100", "--no-kube"),
        ("--root", "/", "cdi", "generate", "--simulate", "dgx-h100"),
        ("mig", "apply", "--root", "/", "--simulate", "dgx-a100-80gb", "-c", "all-1g.10gb"),
        ("--root", "r", "cdi", "generate", "--simulate", "l4x2", "--sim-state", "r/../outside/x.json"),
        ("--root", "r", "mig", "apply", "--simulate", "dgx-a100-80gb", "--sim-state", "r/../x.json", "-c",
         "all-1g.10gb"),
    ):
        accesses = box.traced(*args, expect=2)
        if "--sim-state" in args:  # one line naming the flag
            assert box.output.count("\n") == 1 and "--sim-state" in box.output and "not inside --root" in \
                box.output, box.output
        assert not [
            a
            for a in accesses
            if a.write and not a.path.startswith(ALLOWED_WRITES) and "/__pycache__/" not in a.path
        ], args


def test_the_trace_sees_what_leaves_a_sandbox(box: Sandbox) -> None:
    """The checker itself: a write outside, an exec and a look at a host path are each reported."""
    outside = Path(tempfile.mkdtemp(prefix="nasb-out-", dir="/tmp"))
    try:
        snippet = (
            f"open({str(outside / 'w')!r}, 'w').close(); import os, subprocess; "
            "os.path.exists('/etc/containerd/config.toml'); subprocess.run(['/bin/true']); "
            "os.makedirs('inside/x', exist_ok=True); "
            f"os.symlink('x', {str(outside / 'l')!r}); os.symlink({str(outside)!r}, 'inside/l')"
        )
        accesses = box.traced("-c", snippet, program=(sys.executable,))
        with pytest.raises(AssertionError) as failed:
            box.check(accesses, box.tmp / "inside")
        text = str(failed.value)
        assert "wrote outside: " in text and str(outside / "w") in text, text
        # a link made outside is a write there; a link inside pointing out is not (its text is no path used)
        assert f'symlink("x", "{outside / "l"}")' in text, text
        assert f'symlink("{outside}", ' not in text, text
        assert "executed: " in text and "/bin/true" in text, text
        assert "touched a host path: " in text and "/etc/containerd/config.toml" in text, text
    finally:
        shutil.rmtree(outside, ignore_errors=True)


def test_hints_carry_the_root_and_the_simulator(box: Sandbox) -> None:
    """A hint run literally acts where the command that printed it acted: never on the host instead; and it
    runs as printed (the agent without the API hints bootstrap without it too)."""
    demo = (box.tmp / "demo").resolve()
    box.traced(*DEMO_RUN, long_running=DEMO_SOCKET, said="bootstrap --simulate")
    assert f"run `nodeagent --root {demo} bootstrap --simulate dgx-h100 --no-kube`" in box.output, box.output[-3000:]
    (demo / "var/run/cdi").mkdir(parents=True, exist_ok=True)
    (demo / "var/run/cdi/nvidia.yaml").write_text("cdiVersion: 0.6.0\nkind: nvidia.com/gpu\ndevices: []\n")
    box.traced("--root", "./demo", "cdi", "show", "--simulate", "dgx-h100", "--check", expect=1)
    assert f"run `nodeagent --root {demo} cdi generate --simulate dgx-h100`" in box.output, box.output


def test_bootstrap_under_a_root_restarts_only_when_asked(box: Sandbox) -> None:
    """Under --root, bootstrap leaves containerd alone unless --restart says how (the DaemonSet, whose root
    is the node itself, gives signal); systemd under a root is refused."""
    root = box.tmp / "r"
    (root / "etc/containerd").mkdir(parents=True)
    (root / "etc/containerd/config.toml").write_text('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n')
    args = ["--root", "r", "bootstrap", "--simulate", "t4x1", "--no-kube"]
    quiet = box.run(*args)
    assert quiet.returncode == 0, quiet.stderr
    steps = {s["step"]: s for s in json.loads(quiet.stdout)["steps"]}
    assert steps["runtime"]["result"] == "changed"
    assert steps["containerd-restart"]["result"] == "skipped", steps["containerd-restart"]
    (root / "etc/containerd/config.toml").write_text('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n')
    asked = box.run(*args, "--restart", "signal")
    steps = {s["step"]: s for s in json.loads(asked.stdout)["steps"]}
    assert steps["containerd-restart"]["result"] == "failed", steps  # tried: nothing serves r's socket
    assert "no process is serving" in steps["containerd-restart"]["reason"], steps
    refused = box.run(*args, "--restart", "systemd")
    assert refused.returncode == 2 and "--restart systemd restarts this host's containerd" in refused.stderr


MPS_CONFIG = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"


def test_mps_on_the_simulator_runs_nothing_of_the_root_and_stays_inside(box: Sandbox, outside: Path) -> None:
    """``run`` with ``sharing.mps`` on the simulator: the MPS control daemon is the simulator's stand-in (this
    interpreter), never the root's ``nvidia-cuda-mps-control``; its pipe and log directories, links out of
    the root here, are followed inside the root, where its control socket and log are made."""
    root = box.tmp / "r"
    (root / "usr/bin").mkdir(parents=True)
    marker = box.tmp / "ran"
    (root / "usr/bin/nvidia-cuda-mps-control").write_text(f"#!/bin/sh\ntouch {marker}\n")
    (root / "usr/bin/nvidia-cuda-mps-control").chmod(0o755)
    (root / "etc/nodeagent").mkdir(parents=True)
    (root / "etc/nodeagent/dp.yaml").write_text(MPS_CONFIG)
    daemon_dir = root / "run/nodeagent/mps/nvidia.com_gpu"
    daemon_dir.mkdir(parents=True)
    (outside / "pipe").mkdir()
    (outside / "log").mkdir()
    (daemon_dir / "pipe").symlink_to(outside / "pipe")
    (daemon_dir / "log").symlink_to(f"{_up(root)}{outside}/log")
    control = root / str(outside).lstrip("/") / "pipe/control"
    accesses = box.traced(
        "--root", "r", "run", "--simulate", "t4x1", "--sim-state", "r/sim.json", "--no-kube",
        "--device-plugin-config", "r/etc/nodeagent/dp.yaml", "--metrics-address", "",
        long_running=str(control), said="MPS daemon for nvidia.com/gpu ready",
    )
    box.check(accesses, root)  # executed: this interpreter only (the stand-in), never the root's program
    box.untouched(accesses, outside)
    assert not marker.exists()
    assert (root / str(outside).lstrip("/") / "log/control.log").is_file()
    assert sorted(p.name for p in outside.rglob("*")) == ["log", "pipe"]  # both left empty



def test_vfio_and_cc_switches_write_sysfs_only_under_the_root(box: Sandbox, outside: Path) -> None:
    """The workload switch (vfio-pci and back) and the CC switch (on and off, the ccadmin stand-in run as
    this interpreter) on the simulator: every sysfs write lands in the root's tree, nothing of the host's
    /sys is touched, nothing but this interpreter is executed."""
    root = box.tmp / "r"
    root.mkdir()
    accesses = box.traced("r", "r/sim.json",
                          program=(sys.executable, str(REPO / "tests/e2e/_switch_driver.py")))
    box.check(accesses, root)
    box.untouched(accesses, outside)
    sysfs_writes = {a.path for a in accesses if a.write and "/sys/bus/pci/" in a.path}
    real = str(root.resolve())
    assert sysfs_writes and all(p.startswith(real + "/") for p in sysfs_writes), sorted(sysfs_writes)[:10]
    assert f"{real}/sys/bus/pci/drivers/vfio-pci/bind" in sysfs_writes
    assert f"{real}/sys/bus/pci/drivers_probe" in sysfs_writes
    assert "bound to vfio-pci" in box.output and "CC mode off → on" in box.output
    assert not any(a.path.startswith("/sys/") for a in accesses), "the host's /sys was looked at"
