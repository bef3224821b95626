"""Every command doctor prints as a fix runs as printed with the options in use (the root, the simulated
machine and its state file, --no-kube, --config): a simulated node driven into each finding that has a
``nodeagent`` command for its fix, each printed command run as it stands (``run`` started until its record
shows it serving, then stopped cleanly), and the finding gone at the next look; and ``adopt`` without
credentials does not advise --no-kube, which it has not."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.agentrecord import read_record
from nodeagent.hostpaths import HostPaths
from tests.e2e._agent import eventually
from tests.e2e.test_doctor import _env, _one
from tests.peers.hostlock import host_owned

MACHINE = "vm-a100-passthrough"  # one GPU that can do MIG, in a VM: a mode change waits for a reboot


@pytest.fixture
def base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="nafix-", dir="/tmp"))  # short: sockets live below it
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _command(fix: str) -> list[str] | None:
    """The ``nodeagent`` command line a fix prints (some follow a few words of advice), as argv for this
    interpreter; None when the fix names none."""
    at = fix.find("nodeagent --root ")
    if at < 0:
        return None
    words = shlex.split(fix[at:])
    return [sys.executable, "-m", "nodeagent", *words[1:]]


def _run_agent(argv: list[str], root: Path, env: dict[str, str], cwd: Path) -> None:
    """``run`` as printed: it starts (its record shows it serving its resource), and stops cleanly."""
    log = cwd / "run.log"
    with log.open("wb") as out:
        agent = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        def serving() -> bool:
            assert agent.poll() is None, f"{shlex.join(argv)} exited {agent.returncode}: {log.read_text()}"
            record = read_record(HostPaths(root))
            return record is not None and record.pid == agent.pid and bool(record.resources)

        eventually(serving, 30, f"{shlex.join(argv)} serving")
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(10) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def test_each_printed_fix_runs_as_printed(base: Path) -> None:
    root, state = base / "node", base / "node/sim.json"
    config = root / "etc/nodeagent/test.toml"
    config.parent.mkdir(parents=True)
    # no metrics listener (a fixed port on a shared machine), and a wiring other than the default
    config.write_text('[metrics]\naddress = ""\n\n[runtime]\ncdi = true\nset_as_default = true\n')
    env = _env(root)
    options = ["--simulate", MACHINE, "--sim-state", str(state), "--no-kube", "--config", str(config)]

    def na(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "nodeagent", "--root", str(root), *args], cwd=base, env=env,
                              capture_output=True, text=True, timeout=120, check=False)

    def doctor() -> list[dict[str, Any]]:
        r = na("doctor", *options, "--json")
        assert r.returncode in (0, 1, 2) and r.stderr == "", r.stderr
        findings: list[dict[str, Any]] = json.loads(r.stdout)["findings"]
        return findings

    # the findings with a nodeagent command for their fix: MIG pending, persistence off, containerd not wired,
    # no CDI spec, a kubelet with nothing registered, the agent not running, a bootstrap that failed
    assert na("mig", "apply", "--simulate", MACHINE, "--sim-state", str(state), "-c", "all-enabled").returncode == 3
    assert na("sim", "inject", "persistence", "disabled", "--sim-state", str(state)).returncode == 0
    plugins = root / "var/lib/kubelet/device-plugins"
    plugins.mkdir(parents=True)
    kubelet = socket.socket(socket.AF_UNIX)
    kubelet.bind(str(plugins / "kubelet.sock"))
    kubelet.listen()
    (root / "run/nodeagent").mkdir(parents=True)
    (root / "run/nodeagent/bootstrap.json").write_text(json.dumps(
        {"exit_code": 1, "steps": [{"step": "runtime", "result": "failed"}]}))
    ran: dict[str, str] = {}  # each command run -> the finding it was printed for
    try:
        for _ in range(4):  # a fix may bring out the next finding (the pending MIG mode hides nothing here)
            new = [(f, argv) for f in doctor() if f["fix"] and (argv := _command(f["fix"])) is not None
                   and shlex.join(argv) not in ran]
            for finding, argv in new:
                line = shlex.join(argv)
                if line in ran:
                    continue
                ran[line] = finding["text"]
                if argv[3:6] == ["--root", str(root), "run"]:
                    _run_agent(argv, root, env, base)
                    continue
                r = subprocess.run(argv, cwd=base, env=env, capture_output=True, text=True, timeout=120,
                                   check=False)
                assert r.returncode == 0, (finding, line, r.stderr)
            if not new:
                break
        findings = doctor()
    finally:
        kubelet.close()
    printed = {" ".join(line.split()[5:]) for line in ran}  # without the interpreter and --root DIR
    sim = f"--simulate {MACHINE} --sim-state {state}"
    agent = f"{sim} --config {config} --no-kube"
    assert printed == {
        f"sim reboot {sim}",
        f"sim inject persistence enabled {sim}",
        "runtime configure --set-as-default --cdi",
        f"cdi generate {sim}",
        f"run {agent}",
        f"bootstrap {agent} --output {root}/run/nodeagent/bootstrap.json",
    }, ran
    # each finding its command was printed for is gone, but those of an agent that runs beside a kubelet that
    # takes its registration (it was stopped again; this kubelet.sock only listens)
    assert sorted(f["text"][:42] for f in findings if f["level"] != "ok") == [
        "nodeagent run is not running on this host;", "the kubelet has no GPU resource registered"], findings


def test_the_fix_without_a_driver_runs_as_printed(base: Path) -> None:
    root = base / "node"
    root.mkdir()
    # the whole-node cluster installs a driver library on this host while it runs: wait until no test does
    with host_owned("a host without an NVIDIA driver"):
        r = subprocess.run([sys.executable, "-m", "nodeagent", "--root", str(root), "doctor", "--no-kube", "--json"],
                           cwd=base, env=_env(root), capture_output=True, text=True, timeout=120, check=False)
    nvml = _one(json.loads(r.stdout)["findings"], "driver", "error", "NVML cannot be used")
    argv = _command(nvml["fix"])
    assert argv is not None and argv[3:] == ["--root", str(root), "doctor", "--simulate", "dgx-h100", "--no-kube"], nvml
    r = subprocess.run(argv, cwd=base, env=_env(root), capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode in (0, 1) and r.stderr == "", r.stderr  # warnings at most: a fresh simulated node
    assert "ok      driver     driver " in r.stdout and "(simulated)" in r.stdout


def test_adopt_without_credentials_does_not_advise_no_kube(base: Path) -> None:
    root = base / "node"
    root.mkdir()
    r = subprocess.run([sys.executable, "-m", "nodeagent", "--root", str(root), "adopt", "--node-name", "n1"],
                       cwd=base, env=_env(root), capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 1 and r.stderr.startswith("error: no Kubernetes credentials; tried "), r.stderr
    assert "--no-kube" not in r.stderr and r.stderr.rstrip().endswith(
        "Give --kubeconfig FILE (adopt works only through the API: run it where the cluster's credentials are, "
        "or in the agent's pod)"), r.stderr


def test_a_mig_change_left_half_done_has_a_fix_that_runs(base: Path) -> None:
    """A GPU instance without a compute instance (what a MIG change killed midway leaves): the fix doctor
    prints removes it and keeps the GPU's whole MIG device, run as printed."""
    import pynvml

    from nodeagent.simulator.open import open_sim

    root, state = base / "node", base / "node/sim.json"
    root.mkdir()
    env = _env(root)

    def na(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "nodeagent", "--root", str(root), *args], cwd=base, env=env,
                              capture_output=True, text=True, timeout=120, check=False)

    assert na("sim", "mig", "--simulate", "dgx-a100-80gb", "--sim-state", str(state), "--gpu", "1",
              "3g.40gb").returncode == 0
    sim = open_sim(None, state)
    sim.nvmlInit()
    gpu = sim.nvmlDeviceGetHandleByIndex(1)
    sim.nvmlDeviceCreateGpuInstance(
        gpu, sim.nvmlDeviceGetGpuInstanceProfileInfo(gpu, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE).id)
    sim.nvmlShutdown()

    def bare() -> list[dict[str, Any]]:
        r = na("doctor", "--sim-state", str(state), "--no-kube", "--json")
        return [f for f in json.loads(r.stdout)["findings"] if "without a compute instance" in f["text"]]

    found = bare()
    assert len(found) == 1 and found[0]["text"].startswith("GPU 1: 1 GPU instance(s)"), found
    argv = _command(found[0]["fix"])
    assert argv is not None and argv[3:] == ["--root", str(root), "sim", "mig", "--gpu", "1", "3g.40gb",
                                             "--sim-state", str(state)], found
    r = subprocess.run(argv, cwd=base, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert bare() == []
    layout = json.loads(na("discover", "--sim-state", str(state), "--json").stdout)["gpus"][1]
    assert [d["profile"] for d in layout["mig_devices"]] == ["3g.40gb"], layout
