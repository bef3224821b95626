"""The simulator's event wait sleeps until the state changes (inotify through watchdog), instead of polling
the file."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from nodeagent.fileio import atomic_write
from nodeagent.hostpaths import HostPaths
from nodeagent.nvmlsource import open_nvml
from nodeagent.simulator import inject
from nodeagent.simulator import state as sim_state
from nodeagent.simulator.machine import load_machine
from nodeagent.simulator.state import SimStore
from nodeagent.simulator.watch import FileWatch


def _later(delay: float, fn: object) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        fn()  # type: ignore[operator]

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_file_watch_wakes_on_atomic_replace_only_for_its_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_text("{}")
    with FileWatch(target) as watch:
        assert watch.wait(0.05) is False  # quiet: times out
        (tmp_path / "neighbour.log").write_text("noise")  # another file in the same directory
        assert watch.wait(0.05) is False
        _later(0.1, lambda: atomic_write(target, '{"a": 1}', backup=False))
        t0 = time.monotonic()
        assert watch.wait(5.0) is True
        assert time.monotonic() - t0 < 1.0


def test_file_watch_sees_in_place_writes_and_deletion(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_text("{}")
    with FileWatch(target) as watch:
        target.write_text("{ }")
        assert watch.wait(1.0) is True
        target.unlink()
        assert watch.wait(1.0) is True


def test_memory_store_wait_wakes_on_transaction() -> None:
    store = SimStore(load_machine("t4x1"))
    seen = store.change_marker()
    assert store.wait_change(seen, 0.05) == seen  # quiet timeout

    def change() -> None:
        with store.transaction() as st:
            st["serial"] += 1

    _later(0.1, change)
    t0 = time.monotonic()
    assert store.wait_change(seen, 5.0) != seen
    assert time.monotonic() - t0 < 1.0


def test_file_store_wakes_on_another_writer(tmp_path: Path) -> None:
    path = tmp_path / "sim.json"
    reader = SimStore(load_machine("dgx-h100"), path)
    writer = SimStore(load_machine("dgx-h100"), path)  # another "process": only the file connects them
    seen = reader.change_marker()
    _later(0.1, lambda: inject.inject_xid(writer, 3, 79))
    t0 = time.monotonic()
    assert reader.wait_change(seen, 5.0) != seen
    assert time.monotonic() - t0 < 1.0
    assert reader.read()["events"][-1]["gpu"] == 3


def test_several_waiters_share_one_watch(tmp_path: Path) -> None:
    path = tmp_path / "sim.json"
    reader = SimStore(load_machine("dgx-h100"), path)
    writer = SimStore(load_machine("dgx-h100"), path)
    seen = reader.change_marker()
    woke: list[float] = []

    def wait() -> None:
        if reader.wait_change(seen, 5.0) != seen:
            woke.append(time.monotonic())

    threads = [threading.Thread(target=wait) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    inject.inject_xid(writer, 0, 48)
    for t in threads:
        t.join(5)
    assert len(woke) == 3
    assert max(woke) - t0 < 1.0


def test_without_inotify_the_store_falls_back_to_polling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_inotify(path: Path) -> FileWatch:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(sim_state, "FileWatch", no_inotify)
    nvml = open_nvml("dgx-h100", tmp_path / "sim.json", HostPaths(tmp_path))
    writer = SimStore(load_machine("dgx-h100"), tmp_path / "sim.json")
    assert nvml.wait_events(0) == []
    _later(0.1, lambda: inject.inject_xid(writer, 2, 79))
    t0 = time.monotonic()
    events = nvml.wait_events(3000)
    assert [(e.gpu_index, e.xid) for e in events] == [(2, 79)]
    assert time.monotonic() - t0 < 1.0
    reads = 0
    store = nvml.nvml.store
    real_read = store.read

    def counting_read() -> Any:
        nonlocal reads
        reads += 1
        return real_read()

    monkeypatch.setattr(store, "read", counting_read)
    assert nvml.wait_events(600) == []
    # one look when the call starts, one before waiting, then one per fallback period
    assert reads <= math.ceil(0.6 / sim_state.FALLBACK_POLL_S) + 2


def test_xid_from_another_process_ends_the_wait_at_once(tmp_path: Path) -> None:
    """``nodeagent sim inject xid`` in a separate process; the waiting adapter wakes by inotify."""
    state = tmp_path / "sim.json"
    nvml = open_nvml("dgx-h100", state, HostPaths(tmp_path))
    assert nvml.wait_events(0) == []  # the event set exists before the fault, as in the daemon
    got: list[tuple[float, list[tuple[int | None, int | None]]]] = []

    def wait() -> None:
        events = nvml.wait_events(20_000)
        got.append((time.monotonic(), [(e.gpu_index, e.xid) for e in events]))

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.05)
    proc = subprocess.run(
        [sys.executable, "-m", "nodeagent", "sim", "inject", "xid", "--sim-state", str(state), "--gpu", "5",
         "--code", "79"],
        capture_output=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False,
    )
    written = time.monotonic()
    assert proc.returncode == 0, proc.stderr.decode()
    waiter.join(20)
    assert got, "wait_events did not return"
    returned, events = got[0]
    assert events == [(5, 79)]
    assert returned - written < 1.0  # woke on the change, long before the 20 s timeout


def test_idle_wait_does_not_poll(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quiet wait looks at the state when it starts and when it times out, nothing in between."""
    nvml = open_nvml("dgx-h100", tmp_path / "sim.json", HostPaths(tmp_path))
    nvml.wait_events(0)
    store = nvml.nvml.store
    reads = 0
    real_read = store.read

    def counting_read() -> Any:
        nonlocal reads
        reads += 1
        return real_read()

    monkeypatch.setattr(store, "read", counting_read)
    assert nvml.wait_events(600) == []
    assert reads <= 3  # polling every 50 ms would have looked a dozen times


def test_a_young_file_rewritten_in_place_with_the_same_stamp_is_read_again(tmp_path: Path) -> None:
    """Same inode, same size, the same mtime put back: only the bytes differ. While the file is young (its
    mtime within the last second, a coarse clock's reach) every read compares them, so the change is seen."""
    path = tmp_path / "sim.json"
    store = SimStore(load_machine("dgx-h100"), path)
    with store.transaction() as st:
        st["serial"] = 1
    assert store.read()["serial"] == 1
    before = path.stat()
    raw = path.read_bytes()
    changed = raw.replace(b'"serial": 1', b'"serial": 7')
    assert changed != raw and len(changed) == len(raw)
    with path.open("r+b") as f:  # in place: the inode stays
        f.write(changed)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert store.read()["serial"] == 7
