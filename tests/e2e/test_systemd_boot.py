"""Bare metal for real: the .deb installed with apt-get on a Debian bookworm that systemd boots as PID 1.

The root (``NODEAGENT_DEBIAN_ROOT``: mmdebstrap's bookworm with systemd, dbus, Debian's containerd and runc,
built by tests/testbin/setup.sh) is booted with systemd-nspawn as an overlay (tests/e2e/_nspawn.py). Before
the first boot the test adds what a GPU node has besides nodeagent: the NVML ABI stand-in as the driver's
``libnvidia-ml.so.1`` with the simulated machine named in a drop-in of each unit (as docs/bare-metal.md
tells an operator), and a ``kubelet.service`` that runs the kubelet's own device manager
(``NODEAGENT_KUBELET_HARNESS``). containerd is Debian's, started by the root's own containerd.service.

Three boots of the same machine, in the order of the tests below:
  boot 1  apt-get install ./nodeagent_*.deb (postinst enables both units and starts the agent);
  boot 2  the first boot with the package: bootstrap before the kubelet, the agent's unit, watchdog, reload,
          stop/restart, hardening, the sandbox;
  boot 3  the second boot: the bootstrap has nothing to do; then apt-get remove and purge.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.cdi.simhost import SIM_CAPS_MAJOR, SIM_UVM_MAJOR, mig_minors_text
from tests.e2e._agent import REPO
from tests.e2e._nspawn import BootedRoot, JournalEntry
from tests.peers.hostlock import host_owned

AGENT = "nodeagent.service"
BOOTSTRAP = "nodeagent-bootstrap.service"
MACHINE = "dgx-h100"
GPUS = 8
DRIVER_SIM = "/usr/local/lib/nvidia-driver-sim"  # in the root: stand-ins of the driver's /proc and /dev files
MIG_CONFIG = "all-1g.10gb"
SIM_STATE = "/var/lib/gpu-sim/state.json"
DP_DIR = "/var/lib/kubelet/device-plugins"
# systemd's message ids: a job started / a job finished (journalctl --catalog)
JOB_START = "7d4958e842da4a758f6c1cdc7b36dcc5"
JOB_DONE = "39f53479d3a045ac8e11786248231fbf"
# how the kernel's EPERM/EROFS/EACCES read in a log line
SANDBOX_ERRORS = re.compile(
    r"Read-only file system|Operation not permitted|Permission denied|EROFS|EPERM|EACCES|"
    r"Errno 1\]|Errno 13\]|Errno 30\]"
)


# The operator's part, as docs/bare-metal.md writes it for simulated GPUs: the stand-in library is the
# driver's libnvidia-ml.so.1; a drop-in gives both units the machine, the driver's state file and that
# file's directory writable in their sandbox.
def _readme_gpu_sim_dropin() -> str:
    section = (REPO / "docs/bare-metal.md").read_text().split("## Bare metal", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```ini\n(.*?)```", section, re.S)
    assert m is not None, "no ```ini drop-in in docs/bare-metal.md's Bare metal section"
    return m.group(1)


# The kernel side of the driver, which the library cannot give: the fixed table of MIG access minors
# (/proc/driver/nvidia-caps/mig-minors), the nvidia-caps major (/proc/devices) and the access nodes
# /dev/nvidia-caps/*, which the CDI spec names for each MIG device; mounted into the units' sandboxes where
# the driver has them (a unit gets a /proc of its own, so a mount made in the container would not show).
DRIVER_FILES_DROPIN = f"""BindReadOnlyPaths={DRIVER_SIM}/proc/driver:/proc/driver {DRIVER_SIM}/proc/devices:/proc/devices
BindReadOnlyPaths={DRIVER_SIM}/dev/nvidia-caps:/dev/nvidia-caps
"""
# A MIG layout at boot: the bootstrap's command line with --mig-config (docs/bare-metal.md, "Provisioning").
# The packaged WatchdogSec= (30 s) made the two watchdog checks wait 90 s and up to 30 s; a shorter interval
# tests the same pings and the same kill (the agent pings every half interval, whatever WATCHDOG_USEC says).
PACKAGED_WATCHDOG_SEC = 30
WATCHDOG_SEC = 12
WATCHDOG_DROPIN = f"[Service]\nWatchdogSec={WATCHDOG_SEC}\n"

BOOTSTRAP_MIG_DROPIN = f"""[Service]
ExecStart=
ExecStart=/usr/bin/nodeagent bootstrap --no-kube --mig-config {MIG_CONFIG} --output /run/nodeagent/bootstrap.json
"""
# No API server on this machine: the agent serves the kubelet and wires the runtime only.
AGENT_CONFIG = "kube = false\n\n[metrics]\ninterval = 15.0\n"
KUBELET_UNIT = f"""[Unit]
Description=kubelet stand-in: the kubelet's device manager (k8s.io/kubernetes devicemanager)
Wants=containerd.service
After=containerd.service

[Service]
# commands arrive as JSON lines on the FIFO, answers go to the journal; opened read-write so it never sees EOF
ExecStartPre=/bin/sh -c 'rm -f /run/kubelet.in && mkfifo -m 0600 /run/kubelet.in'
ExecStart=/bin/sh -c 'exec 3<>/run/kubelet.in; exec /usr/local/bin/kubelet --dir {DP_DIR} -v 2 <&3'
Restart=always

[Install]
WantedBy=multi-user.target
"""


def _deb_build(out: Path) -> Path:
    proc = subprocess.run(
        ["nice", "-n", "10", "bash", str(REPO / "packaging/build-deb.sh"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


def _peer(var: str, what: str) -> Path:
    value = os.environ.get(var, "")
    if not value or not Path(value).exists():
        pytest.fail(
            f"{what}: {var} is not set or missing ({value!r}); run `bash tests/testbin/setup.sh` "
            "(step nodeagent_peers_debian_root / nodeagent_peers_nvml_abi / nodeagent_peers_harness)",
            pytrace=False,
        )
    return Path(value)


def _write(root: Path, path: str, text: str, mode: int = 0o644) -> None:
    dest = root / path.lstrip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)
    dest.chmod(mode)


def _driver_kernel_files(base: Path) -> None:
    """What the NVIDIA kernel module shows of the simulated machine's GPUs, as plain files under ``base``."""
    minors = mig_minors_text(list(range(GPUS)))
    _write(base, "/proc/driver/nvidia-caps/mig-minors", minors, 0o444)
    _write(
        base,
        "/proc/devices",
        "Character devices:\n  1 mem\n195 nvidia-frontend\n"
        f"{SIM_UVM_MAJOR} nvidia-uvm\n{SIM_CAPS_MAJOR} nvidia-caps\n\nBlock devices:\n  8 sd\n",
        0o444,
    )
    caps = base / "dev/nvidia-caps"
    caps.mkdir(parents=True)
    for line in minors.splitlines():
        (caps / f"nvidia-cap{line.split()[1]}").write_text("")


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BootedRoot]:
    """Boot 1: the Debian root with the node's other parts, and the .deb installed with apt-get."""
    for tool, package in (("systemd-nspawn", "systemd-container"), ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            pytest.fail(
                f"{tool} is missing: apt-get install {package} (tests/testbin/setup.sh does)", pytrace=False
            )
    lower = _peer("NODEAGENT_DEBIAN_ROOT", "the Debian root")
    library = _peer("NODEAGENT_NVML_LIBRARY", "the NVML ABI stand-in")
    kubelet = _peer("NODEAGENT_KUBELET_HARNESS", "the kubelet device-manager harness")
    deb = _deb_build(tmp_path_factory.mktemp("deb"))
    with host_owned("the booted Debian root"):  # one host-owning test at a time
        node = BootedRoot(lower, tmp_path_factory.mktemp("node"), f"na{os.getpid()}")
        try:
            root = node.merged
            _driver_kernel_files(root / DRIVER_SIM.lstrip("/"))
            shutil.copy(deb, root / "root" / deb.name)
            shutil.copy(library, root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")
            shutil.copy(kubelet, root / "usr/local/bin/kubelet")
            (root / "var/lib/gpu-sim").mkdir(parents=True, exist_ok=True)
            _write(root, "/etc/systemd/system/kubelet.service", KUBELET_UNIT)
            wants = root / "etc/systemd/system/multi-user.target.wants"
            wants.mkdir(parents=True, exist_ok=True)
            (wants / "kubelet.service").symlink_to("/etc/systemd/system/kubelet.service")
            dropin = _readme_gpu_sim_dropin()
            assert f"NODEAGENT_SIM_MACHINE={MACHINE} " in dropin and f"NODEAGENT_NVML_STATE={SIM_STATE}" in dropin
            dropin += DRIVER_FILES_DROPIN
            for unit in (AGENT, BOOTSTRAP):
                _write(root, f"/etc/systemd/system/{unit}.d/gpu-sim.conf", dropin)
            _write(root, f"/etc/systemd/system/{BOOTSTRAP}.d/mig.conf", BOOTSTRAP_MIG_DROPIN)
            _write(root, f"/etc/systemd/system/{AGENT}.d/watchdog.conf", WATCHDOG_DROPIN)
            _write(root, "/etc/nodeagent/config.toml", AGENT_CONFIG)
            node.boot()
            node.run(["ldconfig"])
            start = time.monotonic()
            proc = node.run(
                ["apt-get", "install", "-y", "-q", "-o", "Dpkg::Options::=--force-confold", f"/root/{deb.name}"],
                env={"DEBIAN_FRONTEND": "noninteractive"},
                timeout=180,
                check=False,
            )
            node.install_output = proc.stdout + proc.stderr  # type: ignore[attr-defined]
            node.install_rc = proc.returncode  # type: ignore[attr-defined]
            node.install_seconds = time.monotonic() - start  # type: ignore[attr-defined]
            yield node
        finally:
            node.close()


@pytest.fixture(scope="module")
def boot2(machine: BootedRoot) -> BootedRoot:
    """The first boot with the package installed."""
    machine.poweroff()
    machine.boot()
    return machine


@pytest.fixture(scope="module")
def boot3(boot2: BootedRoot) -> BootedRoot:
    """The second boot with the package installed."""
    boot2.poweroff()
    boot2.boot()
    return boot2


def _job(entries: list[JournalEntry], unit: str, message_id: str) -> JournalEntry:
    """The first record of ``unit``'s start job: begun (JOB_START) or ended, whatever its result (JOB_DONE)."""
    for e in entries:
        if e.unit != unit or e.identifier != "systemd":
            continue
        if message_id == JOB_START and e.fields.get("MESSAGE_ID") == JOB_START:
            return e
        if message_id == JOB_DONE and e.fields.get("JOB_TYPE") == "start" and e.fields.get("JOB_RESULT"):
            return e
    lines = "\n".join(e.message for e in entries if e.unit == unit)
    raise AssertionError(f"no {message_id} journal record for {unit}; its lines:\n{lines[-6000:]}")


def _kubelet_cmd(node: BootedRoot, cmd: dict[str, object], timeout: float = 30) -> dict[str, object]:
    """One command to the kubelet stand-in; its answer from the journal."""
    before = len(node.journal("-u", "kubelet.service", "-o", "json"))
    with node.path("/run/kubelet.in").open("w") as fifo:
        fifo.write(json.dumps(cmd) + "\n")

    def answer() -> dict[str, object] | None:
        for e in node.journal("-u", "kubelet.service")[before:]:
            if e.message.startswith("{"):
                value: dict[str, object] = json.loads(e.message)
                return value
        return None

    result: dict[str, object] = node.wait_for(f"kubelet stand-in answer to {cmd}", answer, timeout)
    return result


def _plugin_sockets(node: BootedRoot) -> list[Path]:
    return sorted(p for p in (node.merged / DP_DIR.lstrip("/")).glob("*.sock") if p.name != "kubelet.sock")


# --- boot 1: the install --------------------------------------------------------------------------------
def test_apt_get_install_enables_both_units_and_starts_the_agent(machine: BootedRoot) -> None:
    out: str = machine.install_output  # type: ignore[attr-defined]
    assert machine.install_rc == 0, out  # type: ignore[attr-defined]
    assert "Setting up nodeagent" in out, out
    assert "not started" not in out, out
    for unit in (AGENT, BOOTSTRAP):
        assert machine.run(["systemctl", "is-enabled", unit]).stdout.strip() == "enabled"
    assert (machine.merged / "etc/systemd/system/kubelet.service.wants" / BOOTSTRAP).is_symlink()
    state = machine.wait_for(
        "nodeagent active after the install",
        lambda: machine.show(AGENT, "ActiveState", "SubState")["SubState"] == "running",
        30,
    )
    assert state
    print(f"install took {machine.install_seconds:.1f}s")  # type: ignore[attr-defined]


# --- boot 2: the first boot with the package ------------------------------------------------------------
def test_bootstrap_runs_before_the_kubelet_and_wires_containerd(boot2: BootedRoot) -> None:
    """Check 1 (order, containerd) and 6 (the bootstrap's whole job in its sandbox)."""
    journal = boot2.journal()
    boot_done = _job(journal, BOOTSTRAP, JOB_DONE)
    kubelet_start = _job(journal, "kubelet.service", JOB_START)
    assert boot_done.seq < kubelet_start.seq, (boot_done, kubelet_start)
    assert boot_done.fields.get("JOB_RESULT") == "done", "\n".join(
        e.message for e in journal if e.unit == BOOTSTRAP
    )
    report = json.loads(boot2.path("/run/nodeagent/bootstrap.json").read_text())
    outcomes = {s["step"]: s["result"] for s in report["steps"]}
    assert outcomes["mig"] == "changed" and outcomes["runtime"] == "changed", report
    assert outcomes["containerd-restart"] == "changed", report
    assert "failed" not in outcomes.values(), report
    # containerd restarted by the bootstrap (over D-Bus), between the bootstrap's start and its end
    boot_start = _job(journal, BOOTSTRAP, JOB_START)
    restarts = [
        e
        for e in journal
        if e.unit == "containerd.service"
        and e.fields.get("MESSAGE_ID") == JOB_START
        and boot_start.seq < e.seq < boot_done.seq
    ]
    assert restarts, [e.message for e in journal if e.unit == "containerd.service"]
    # the wiring loads: containerd's own view of its config has the nvidia runtime
    dump = boot2.run(["containerd", "config", "dump"]).stdout
    assert re.search(r"runtimes\.nvidia\]", dump), dump[-3000:]
    assert (boot2.merged / "etc/containerd/conf.d/99-nvidia.toml").is_file()
    assert boot2.show("containerd.service", "ActiveState")["ActiveState"] == "active"
    # the MIG layout is the driver's now (the stand-in's state) and the agent's MIG state file is written
    assert (boot2.merged / SIM_STATE.lstrip("/")).is_file()
    assert any((boot2.merged / "var/lib/nodeagent").rglob("*")), "no MIG state under /var/lib/nodeagent"
    assert outcomes["cdi"] == "changed", report
    spec = boot2.path("/run/cdi/nvidia.yaml").read_text()
    assert "nvidia-caps/nvidia-cap" in spec, spec[:2000]
    bad = [e.message for e in boot2.journal("-u", BOOTSTRAP) if SANDBOX_ERRORS.search(e.message)]
    assert not bad, bad


def test_agent_is_active_only_after_ready_and_serves_the_kubelet(boot2: BootedRoot) -> None:
    """Check 1: Type=notify works (READY, STATUS), the device-plugin sockets are 0600 and registered."""
    props = boot2.show(AGENT, "Type", "NotifyAccess", "ActiveState", "SubState", "StatusText", "NRestarts")
    assert props["Type"] == "notify" and props["NotifyAccess"] == "main", props
    assert (props["ActiveState"], props["SubState"]) == ("active", "running"), props
    assert props["StatusText"], props
    assert props["NRestarts"] == "0", props
    journal = boot2.journal()
    ready = [e for e in journal if e.unit == AGENT and "ready after" in e.message]
    started = _job(journal, AGENT, JOB_DONE)
    assert ready and ready[0].seq < started.seq, ([e.message for e in ready], started.message)
    socks = _plugin_sockets(boot2)
    assert socks, sorted(os.listdir(boot2.merged / DP_DIR.lstrip("/")))
    assert {oct(p.stat().st_mode & 0o777) for p in socks} == {"0o600"}, socks
    listing = _kubelet_cmd(boot2, {"cmd": "list"})
    resources = listing.get("resources") or {}
    assert isinstance(resources, dict) and resources, listing
    assert any(r.get("registered") and r.get("capacity", 0) > 0 for r in resources.values()), listing


def _readme_scores() -> dict[str, str]:
    text = (REPO / "docs/bare-metal.md").read_text()
    found = dict(
        (unit, score)
        for score, unit in re.findall(r"exposure \*\*(\d+\.\d)\*\* for\s+`([\w-]+\.service)`", text)
    )
    found.update(
        (unit, score) for score, unit in re.findall(r"\*\*(\d+\.\d)\*\* for `([\w-]+\.service)`", text)
    )
    assert set(found) == {AGENT, BOOTSTRAP}, found
    return found


def test_every_hardening_option_is_accepted_and_scores_are_the_readmes(boot2: BootedRoot) -> None:
    """Check 5: no unit-file complaint from the booted systemd; `systemd-analyze security` on the live units."""
    complaints = re.compile(
        r"Unknown key|Unknown section|Unknown lvalue|Ignoring|Failed to parse|unsupported|"
        r"not supported",
        re.IGNORECASE,
    )
    bad = [
        e.message
        for e in boot2.journal()
        if e.identifier == "systemd" and "nodeagent" in e.message and complaints.search(e.message)
    ]
    assert not bad, bad
    verify = boot2.run(["systemd-analyze", "verify", AGENT, BOOTSTRAP], check=False)
    assert verify.returncode == 0 and "nodeagent" not in verify.stdout + verify.stderr, (
        verify.stdout + verify.stderr
    )
    scores = {}
    for unit in (AGENT, BOOTSTRAP):
        out = boot2.run(["systemd-analyze", "security", "--no-pager", unit]).stdout
        m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out)
        assert m is not None, out
        scores[unit] = m.group(1)
    print(f"systemd {boot2.run(['systemctl', '--version']).stdout.split()[1]}: exposure {scores}")
    assert scores == _readme_scores(), (scores, _readme_scores())


def test_the_agent_does_its_job_in_the_sandbox_without_a_refusal(boot2: BootedRoot) -> None:
    """Check 6, the agent's side (the bootstrap's is checked above): CDI spec, device-plugin sockets, state and
    runtime directories; no EPERM/EROFS/EACCES in either unit's journal."""
    agent = boot2.journal("-u", AGENT)
    assert any("component cdi started" in e.message for e in agent), [e.message for e in agent]
    assert not [e.message for e in agent if "cdi:" in e.message and "WARNING" in e.message]
    spec = boot2.path("/run/cdi/nvidia.yaml").read_text()
    assert spec.count("nvidia-caps/nvidia-cap") >= 2 * GPUS * 7, spec[:2000]  # 7 MIG devices a GPU, GI + CI
    assert any("registered nvidia.com/gpu with the kubelet" in e.message for e in agent), [
        e.message for e in agent
    ]
    bad = [e.message for e in agent + boot2.journal("-u", BOOTSTRAP) if SANDBOX_ERRORS.search(e.message)]
    assert not bad, bad
    assert not [e.message for e in agent if e.message.startswith("Traceback")]


def test_reload_applies_a_good_config_and_rejects_a_bad_one_in_one_line(boot2: BootedRoot) -> None:
    """Check 3: `systemctl reload nodeagent` (SIGHUP)."""
    pid = boot2.show(AGENT, "MainPID")["MainPID"]
    config = boot2.merged / "etc/nodeagent/config.toml"

    def reload_and_wait(text: str, needle: str) -> list[str]:
        config.write_text(text)
        mark = len(boot2.journal("-u", AGENT))
        boot2.run(["systemctl", "reload", AGENT], timeout=60)
        return boot2.wait_for(
            f"journal line {needle!r}",
            lambda: [e.message for e in boot2.journal("-u", AGENT)[mark:] if needle in e.message],
            30,
        )

    try:
        applied = reload_and_wait(
            AGENT_CONFIG.replace("interval = 15.0", "interval = 20.0"), "reload: changed"
        )
        assert applied == [applied[0]] and "metrics" in applied[0], applied
        rejected = reload_and_wait(AGENT_CONFIG + "\n[mig]\nwith_rebot = true\n", "reload rejected")
        assert len(rejected) == 1 and "mig.with_rebot" in rejected[0], rejected
        props = boot2.show(AGENT, "MainPID", "ActiveState", "SubState", "NRestarts")
        assert props == {"MainPID": pid, "ActiveState": "active", "SubState": "running", "NRestarts": "0"}, (
            props
        )
    finally:
        config.write_text(AGENT_CONFIG)
        boot2.run(["systemctl", "reload", AGENT], timeout=60)


def test_healthy_agent_is_not_restarted_for_three_watchdog_intervals(boot2: BootedRoot) -> None:
    """Check 2, first half: the agent's own pings keep the watchdog (WatchdogSec=) quiet."""
    props = boot2.show(AGENT, "WatchdogUSec", "ExecMainStartTimestampMonotonic", "MainPID", "NRestarts")
    watchdog = _seconds(props["WatchdogUSec"])
    assert watchdog == WATCHDOG_SEC, props  # the test's drop-in over the packaged unit's value
    assert f"\nWatchdogSec={PACKAGED_WATCHDOG_SEC}\n" in (REPO / "systemd" / AGENT).read_text()
    started = int(props["ExecMainStartTimestampMonotonic"]) / 1e6  # CLOCK_MONOTONIC, the same as this host's
    time.sleep(max(0.0, started + 3 * watchdog + 1 - time.monotonic()))
    after = boot2.show(AGENT, "MainPID", "NRestarts", "ActiveState")
    assert (after["MainPID"], after["NRestarts"], after["ActiveState"]) == (
        props["MainPID"],
        "0",
        "active",
    ), after
    assert not [e.message for e in boot2.journal("-u", AGENT) if "atchdog" in e.message]


def test_watchdog_restarts_a_stopped_agent(boot2: BootedRoot) -> None:
    """Check 2, second half: SIGSTOP the agent; systemd kills it after WatchdogSec= and starts it again."""
    props = boot2.show(AGENT, "WatchdogUSec", "MainPID")
    watchdog = _seconds(props["WatchdogUSec"])
    stopped_at = time.monotonic()
    os.kill(boot2.host_pid(int(props["MainPID"])), 19)  # SIGSTOP
    timeout_line = boot2.wait_for(
        "watchdog timeout",
        lambda: [e for e in boot2.journal("-u", AGENT) if "Watchdog timeout" in e.message],
        watchdog + 30,
    )
    waited = time.monotonic() - stopped_at
    # The agent pings every WatchdogSec/2 (sd_watchdog_enabled's advice), so the last ping before the stop is
    # at most half an interval old: systemd fires between half and the whole interval after it.
    assert watchdog / 2 - 1 <= waited, (waited, timeout_line)

    def restarted() -> bool:
        now = boot2.show(AGENT, "SubState", "MainPID", "NRestarts")
        return now["SubState"] == "running" and now["MainPID"] != props["MainPID"] and now["NRestarts"] == "1"

    boot2.wait_for("agent running again", restarted, 60)


def test_stop_ends_in_time_and_removes_sockets_restart_registers_again(boot2: BootedRoot) -> None:
    """Check 4."""
    stop_timeout = _seconds(boot2.show(AGENT, "TimeoutStopUSec")["TimeoutStopUSec"])
    start = time.monotonic()
    boot2.run(["systemctl", "stop", AGENT], timeout=stop_timeout + 30)
    took = time.monotonic() - start
    props = boot2.show(AGENT, "ActiveState", "Result")
    assert props == {"ActiveState": "inactive", "Result": "success"}, props
    assert took < stop_timeout, took
    assert _plugin_sockets(boot2) == []

    def registrations(since: int) -> list[str]:
        return [
            e.message
            for e in boot2.journal("-u", "kubelet.service")[since:]
            if "Got registration request" in e.message
        ]

    for verb in ("start", "restart"):
        mark = len(boot2.journal("-u", "kubelet.service"))
        boot2.run(["systemctl", verb, AGENT], timeout=120)
        assert boot2.show(AGENT, "SubState")["SubState"] == "running"
        assert boot2.wait_for(f"registration after {verb}", lambda: registrations(mark), 30)  # noqa: B023
    assert len(_plugin_sockets(boot2)) >= 1


def _doctor_in(node: BootedRoot) -> list[dict[str, str]]:
    """``nodeagent doctor --no-kube --json`` as an operator types it on the node (the driver's simulated machine
    as the units' drop-in names it)."""
    r = node.run(["nodeagent", "doctor", "--no-kube", "--json"], timeout=60, check=False,
                 env={"NODEAGENT_SIM_MACHINE": MACHINE, "NODEAGENT_NVML_STATE": SIM_STATE})
    assert r.returncode in (0, 1, 2) and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    findings: list[dict[str, str]] = json.loads(r.stdout)["findings"]
    return findings


def _unit_findings(findings: list[dict[str, str]]) -> list[dict[str, str]]:
    return [f for f in findings if f["area"] == "agent" and f["text"].startswith(f"{AGENT} ")]


def test_doctor_reads_the_units_state_and_asks_containerd(boot2: BootedRoot) -> None:
    """On the host itself doctor asks systemd for the unit's state and containerd for its verdict on its config."""
    start = time.monotonic()
    findings = _doctor_in(boot2)
    unit = _unit_findings(findings)
    assert len(unit) == 1 and unit[0]["level"] == "ok", findings
    assert unit[0]["text"].startswith(f"{AGENT} active (running), result success"), unit
    loads = [f for f in findings if f["area"] == "containerd" and f["text"].startswith("containerd loads ")]
    assert loads and loads[0]["level"] == "ok", findings  # Debian's containerd 1.6 on the root's own config
    assert loads[0]["text"] == ("containerd loads /etc/containerd/config.toml (/usr/bin/containerd --config "
                                "/etc/containerd/config.toml config dump)"), loads

    config = boot2.merged / "etc/nodeagent/config.toml"
    try:
        config.write_text(AGENT_CONFIG + "\n[mig]\nwith_rebot = true\n")  # the agent exits at its start
        boot2.run(["systemctl", "restart", "--no-block", AGENT])

        def failing() -> list[dict[str, str]]:
            return [f for f in _unit_findings(_doctor_in(boot2)) if f["level"] == "error"]

        (error,) = boot2.wait_for("doctor reporting the failing unit", failing, 60)
        assert "result exit-code" in error["text"], error
        assert error["text"].startswith((f"{AGENT} failed (failed)", f"{AGENT} activating (auto-restart)")), error
        assert error["fix"].startswith("read why: journalctl -u nodeagent -b"), error
    finally:
        config.write_text(AGENT_CONFIG)
        boot2.run(["systemctl", "reset-failed", AGENT], check=False)
        boot2.run(["systemctl", "restart", AGENT], timeout=120)
    assert boot2.show(AGENT, "SubState")["SubState"] == "running"
    print(f"doctor on the booted node: {time.monotonic() - start:.1f}s")


def _seconds(value: str) -> float:
    """A systemd time span as `systemctl show` prints it ("30s", "1min 30s", "100ms")."""
    units = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|min|h)", value):
        total += float(number) * units[unit]
    return total


# --- boot 3: the second boot; then the package goes ------------------------------------------------------
def test_second_boot_bootstrap_has_nothing_to_do_and_the_agent_starts(boot3: BootedRoot) -> None:
    """Check 8."""
    journal = boot3.journal()
    assert _job(journal, BOOTSTRAP, JOB_DONE).fields.get("JOB_RESULT") == "done"
    report = json.loads(boot3.path("/run/nodeagent/bootstrap.json").read_text())
    results = {s["step"]: s["result"] for s in report["steps"]}
    # the CDI spec lives in /run (a tmpfs, empty at every boot): written again; nothing else to do
    assert results.pop("cdi") == "changed", report
    assert set(results.values()) <= {"unchanged", "skipped"}, report
    assert results["mig"] == "unchanged" and results["runtime"] == "unchanged", report
    assert results["containerd-restart"] == "skipped", report
    assert report["exit_code"] == 0, report
    assert boot3.show(AGENT, "SubState", "NRestarts") == {"SubState": "running", "NRestarts": "0"}
    boot3.wait_for(
        "registration",
        lambda: [
            e for e in boot3.journal("-u", "kubelet.service") if "Got registration request" in e.message
        ],
        30,
    )


def test_remove_stops_and_disables_purge_removes_state_containerd_keeps_its_wiring(boot3: BootedRoot) -> None:
    """Check 7 (docs/bare-metal.md: remove and purge leave containerd's config as it is)."""
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    boot3.run(["apt-get", "remove", "-y", "-q", "nodeagent"], env=env, timeout=120)
    for unit in (AGENT, BOOTSTRAP):
        assert boot3.show(unit, "ActiveState", "LoadState") == {
            "ActiveState": "inactive",
            "LoadState": "not-found",
        }
    assert not (boot3.merged / "etc/systemd/system/multi-user.target.wants" / AGENT).exists()
    assert not (boot3.merged / "etc/systemd/system/kubelet.service.wants" / BOOTSTRAP).is_symlink()
    assert (boot3.merged / "var/lib/nodeagent").is_dir()
    assert (boot3.merged / "etc/nodeagent/config.toml").is_file()
    boot3.run(["apt-get", "purge", "-y", "-q", "nodeagent"], env=env, timeout=120)
    assert not (boot3.merged / "var/lib/nodeagent").exists()
    assert not (boot3.merged / "etc/nodeagent").exists()
    assert not (boot3.merged / "opt/nodeagent").exists()
    assert (boot3.merged / "etc/containerd/conf.d/99-nvidia.toml").is_file()
    dump = boot3.run(["containerd", "config", "dump"]).stdout
    assert re.search(r"runtimes\.nvidia\]", dump), dump[-2000:]
    assert boot3.run(["systemctl", "is-system-running"], check=False).stdout.strip() == "running"
