"""The agent's record (/run/nodeagent/agent.json): what the daemon writes at its start, after each reload
(applied, unchanged, rejected, failed) and at a clean stop; runs that ended without a clean stop counted at
the next start; a record that is none refused in one line; a record that cannot be written never stops the
agent."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nodeagent.agentrecord import (
    LOCK,
    MAX_RECORD_BYTES,
    RECORD,
    AgentRecorder,
    Fault,
    LockView,
    OtherAgent,
    Registration,
    lock_holder,
    read_record,
)
from nodeagent.config import AgentConfig, apply_overrides
from nodeagent.daemon import Component, ComponentSpec, Daemon
from nodeagent.errors import ConfigError, InputError
from nodeagent.hostpaths import HostPaths
from nodeagent.sdnotify import Notifier
from tests.unit.test_daemon import Gpus, Recorder, wait_for


class Clock:
    def __init__(self) -> None:
        self.t = 1_790_000_000.0

    def __call__(self) -> float:
        self.t += 1
        return self.t


def test_start_reloads_stop_and_unclean_ends(tmp_path: Path) -> None:
    paths, clock = HostPaths(tmp_path), Clock()
    first = AgentRecorder(paths, clock=clock, pid=100)
    first.started("/etc/nodeagent/config.toml")
    doc = json.loads((tmp_path / RECORD.lstrip("/")).read_text())
    assert doc == {"version": 1, "pid": 100, "started": 1_790_000_001.0, "config": "/etc/nodeagent/config.toml",
                   "starts": 1, "reloads": 0, "last_reload": None, "stopped": None, "unclean_ends": 0,
                   "last_unclean": {}, "unhealthy": [], "health_changed": None, "conflicts": [], "resources": []}
    first.reloaded("rejected", "/etc/nodeagent/config.toml:\n unknown key 'x'")
    first.reloaded("applied", "changed metrics", "/etc/nodeagent/other.toml")
    record = read_record(paths)
    assert record is not None and record.reloads == 2 and record.config == "/etc/nodeagent/other.toml"
    assert record.last_reload is not None
    assert (record.last_reload.outcome, record.last_reload.detail) == ("applied", "changed metrics")
    # killed: no stop recorded; the next start counts it
    second = AgentRecorder(paths, clock=clock, pid=200)
    second.started("")
    record = read_record(paths)
    assert record is not None
    assert (record.pid, record.starts, record.config, record.reloads, record.last_reload) == (200, 2, "defaults", 0,
                                                                                              None)
    assert record.unclean_ends == 1 and record.last_unclean == {"pid": 100, "started": 1_790_000_001.0,
                                                                "seen": clock.t}
    second.stopped()
    third = AgentRecorder(paths, clock=clock, pid=300)
    third.started("")
    record = read_record(paths)
    assert record is not None and (record.starts, record.unclean_ends, record.stopped) == (3, 1, None)
    third.health((Fault(gpu=2, xid=48), Fault(gpu=0, gi=3, xid=94, recovery="GPU reset")))
    record = read_record(paths)
    assert record is not None and record.unhealthy == (Fault(2, 48), Fault(0, 94, 3, "GPU reset"))
    changed = record.health_changed
    third.health(record.unhealthy)  # unchanged: not written again
    assert (read_record(paths) or record).health_changed == changed
    third.health(())
    assert (read_record(paths) or record).unhealthy == ()
    conflict = OtherAgent("device-plugin", "nvidia.com/gpu", "nvidia-gpu.sock", "another device plugin serves ...")
    waiting = Registration("nvidia.com/gpu", "nvidia-gpu.sock", False, "kubelet.sock does not exist")
    third.observed((conflict,), (waiting,))
    record = read_record(paths)
    assert record is not None and (record.conflicts, record.resources) == ((conflict,), (waiting,))
    third.reloaded("failed", "x" * 1000)
    record = read_record(paths)
    assert record is not None and record.last_reload is not None and len(record.last_reload.detail) == 300


@pytest.mark.parametrize("text", ["{", "[]", '{"version": 9}', '{"version": 1, "pid": "x"}',
                                  '{"version": 1, "pid": 1, "started": 1, "starts": 1, "reloads": 0, '
                                  '"unclean_ends": 0, "last_reload": {"outcome": "maybe", "time": 1}}'])
def test_a_record_that_is_none_is_refused_in_one_line_and_a_new_run_starts_afresh(tmp_path: Path, text: str) -> None:
    path = tmp_path / RECORD.lstrip("/")
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(InputError, match=f"^{RECORD} is no agent record: ") as e:
        read_record(HostPaths(tmp_path))
    assert "\n" not in str(e.value)
    AgentRecorder(HostPaths(tmp_path), pid=1).started("")
    record = read_record(HostPaths(tmp_path))
    assert record is not None and (record.pid, record.starts, record.unclean_ends) == (1, 1, 0)


def test_a_record_that_cannot_be_written_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "run").write_text("a file where /run should be a directory")
    recorder = AgentRecorder(HostPaths(tmp_path), pid=1)
    with caplog.at_level(logging.WARNING):
        recorder.started("")
        recorder.reloaded("unchanged")
        recorder.stopped()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"cannot write the agent record {RECORD}"), warnings


async def test_the_daemon_records_each_reload_with_its_outcome(tmp_path: Path) -> None:
    paths = HostPaths(tmp_path)
    configs: list[AgentConfig | Exception] = [AgentConfig()]

    def reload() -> AgentConfig:
        last = configs[-1]
        if isinstance(last, Exception):
            raise last
        return last

    comps: dict[str, Component | None] = {"metrics": Recorder("metrics", []), "mig": Recorder("mig", [])}
    specs = [ComponentSpec(n, frozenset({n}), lambda ctx, n=n: comps[n]) for n in comps]  # type: ignore[misc]
    d = Daemon(AgentConfig(), paths, gpu_factory=lambda c, p: Gpus(), specs=specs, notifier=Notifier({}),
               reload_config=reload, ready_fallback=5, recorder=AgentRecorder(paths))

    def last() -> tuple[str, str]:
        record = read_record(paths)
        assert record is not None and record.last_reload is not None
        return record.last_reload.outcome, record.last_reload.detail

    task = asyncio.create_task(d.run(install_signals=False))
    await wait_for(lambda: d._ready_sent)
    record = read_record(paths)
    assert record is not None and record.last_reload is None and record.stopped is None
    await d.reload()
    assert last() == ("unchanged", "")
    configs.append(apply_overrides(AgentConfig(), {"metrics.address": "127.0.0.1:9401"}))
    await d.reload()
    assert last() == ("applied", "changed metrics")
    configs.append(ConfigError("/etc/nodeagent/config.toml: unknown key 'x'"))
    await d.reload()
    assert last() == ("rejected", "/etc/nodeagent/config.toml: unknown key 'x'")
    configs.append(apply_overrides(AgentConfig(), {"metrics.address": "127.0.0.1:9401",
                                                   "mig.config_file": "/nowhere.yaml"}))
    comps["mig"] = Recorder("mig", [], fail_start=1)
    await d.reload()
    assert last() == ("applied", "changed mig; mig: failed to start: mig cannot start")
    configs.append(RuntimeError("a bug"))  # not a config error: still recorded, as rejected with its type
    await d.reload()
    assert last() == ("rejected", "RuntimeError: a bug")
    d.request_stop()
    await asyncio.wait_for(task, 5)
    record = read_record(paths)
    assert record is not None and record.reloads == 5 and record.stopped is not None


@pytest.mark.parametrize("entry", ["loop", "fifo", "dangling"])
def test_the_agents_own_record_never_stops_it(tmp_path: Path, entry: str, caplog: pytest.LogCaptureFixture) -> None:
    """A link loop, a FIFO or a dangling link at the record's name: replaced by the record with one warning
    (a loop made ``run`` exit 2 before it started)."""
    path = tmp_path / RECORD.lstrip("/")
    path.parent.mkdir(parents=True)
    if entry == "loop":
        path.symlink_to(path.name)
    elif entry == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/nowhere/agent.json")
    recorder = AgentRecorder(HostPaths(tmp_path), pid=7)
    with caplog.at_level(logging.WARNING):
        recorder.started("")
        recorder.reloaded("unchanged")
        recorder.stopped()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    kind = "a FIFO" if entry == "fifo" else "a symbolic link"
    assert warnings == [f"{RECORD} was {kind}, not the agent's file: replaced"], warnings
    assert not path.is_symlink() and path.is_file()
    record = read_record(HostPaths(tmp_path))
    assert record is not None and record.pid == 7 and record.reloads == 1 and record.stopped is not None


def test_the_running_agent_holds_its_lock_until_its_clean_stop(tmp_path: Path) -> None:
    """doctor tells the record's run from the lock: held by this process while it runs, free after its stop;
    no lock file at all says nothing (a recorder of another pid takes none)."""
    paths = HostPaths(tmp_path)
    AgentRecorder(paths, pid=4242).started("")
    assert not lock_holder(paths).present
    lock = tmp_path / LOCK.lstrip("/")
    lock.symlink_to(lock.name)  # a loop at the lock's name is replaced too
    recorder = AgentRecorder(paths)
    recorder.started("")

    def seen_from_another_process() -> str:  # (F_GETLK never reports the asking process's own lock)
        code = ("import sys; from nodeagent.agentrecord import lock_holder; from nodeagent.hostpaths import HostPaths; "
                "print(lock_holder(HostPaths(sys.argv[1])))")
        return subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                              check=True).stdout.strip()

    assert seen_from_another_process() == repr(LockView(True, os.getpid()))
    recorder.stopped()
    assert seen_from_another_process() == repr(LockView(True, None))


def test_what_the_agent_observed_stays_within_what_doctor_reads(tmp_path: Path) -> None:
    paths = HostPaths(tmp_path)
    recorder = AgentRecorder(paths, pid=9)
    recorder.started("")
    many = tuple(OtherAgent("feature-labels", f"label-{i}", "nfd", "x" * 5000) for i in range(100))
    waiting = tuple(Registration(f"nvidia.com/mig-{i}g", f"nvidia-mig-{i}g.sock", False, "y" * 5000) for i in range(100))
    recorder.observed(many, waiting)
    assert (tmp_path / RECORD.lstrip("/")).stat().st_size < MAX_RECORD_BYTES
    record = read_record(paths)
    assert record is not None and len(record.conflicts) == len(record.resources) == 32
    assert len(record.conflicts[0].detail) == len(record.resources[0].why) == 600
