"""The agent's record (/run/nodeagent/agent.json): what the daemon writes at its start, after each reload
(applied, unchanged, rejected, failed) and at a clean stop; runs that ended without a clean stop counted at
the next start; a record that is none refused in one line; a record that cannot be written never stops the
agent."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from nodeagent.agentrecord import RECORD, AgentRecorder, Fault, read_record
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
                   "last_unclean": {}, "unhealthy": [], "health_changed": None}
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
