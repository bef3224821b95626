"""The simulator's mutable state: MIG modes, instances, processes, faults and events.

The state is a JSON document. With a file it outlives processes like hardware state does: every change
happens under an exclusive ``flock`` on the file's directory (no lock file is left beside the state; the
state files of one directory share that lock), re-reads the file first and replaces it
atomically, so a test or ``nodeagent sim inject`` can change it under a running daemon. Readers notice
such changes by the file's identity (inode, size, mtime). Without a file the state lives in memory.

``SimStore.change_marker``/``wait_change`` let a blocking reader (the NVML event wait) sleep until the
state may have changed: inotify on the file's directory (see ``watch.py``; one descriptor per store, kept
open because closing an inotify instance costs milliseconds), a condition variable for changes made by
this process, and a slow poll only where inotify is unavailable.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nodeagent.boundedyaml import shown
from nodeagent.errors import InputError
from nodeagent.fileio import UnreadableFileError, atomic_write, read_regular
from nodeagent.simulator.machine import SimMachine, load_machine
from nodeagent.simulator.watch import FileWatch

log = logging.getLogger(__name__)

STATE_VERSION = 1
MAX_EVENTS = 256
FALLBACK_POLL_S = 0.25  # re-read interval of a waiter when the file cannot be watched with inotify

# A test that must stop a process at one exact state (tests/e2e/test_drills.py) names a directory here; while
# it holds the FIFOs ``go`` and ``done``, every change of a file-backed state waits for one byte on ``go``
# before the file is replaced and puts one byte on ``done`` after, so the test sees each state in turn.
STEP_GATE_ENV = "NODEAGENT_SIM_STEP_GATE"


def _step_gate() -> Path | None:
    where = os.environ.get(STEP_GATE_ENV)
    if not where:
        return None
    gate = Path(where)
    return gate if (gate / "go").exists() else None


def _await_step(gate: Path) -> None:
    fd = os.open(gate / "go", os.O_RDONLY | os.O_CLOEXEC)  # the test holds the other end open
    try:
        os.read(fd, 1)
    finally:
        os.close(fd)


def _step_done(gate: Path) -> None:
    with contextlib.suppress(OSError):  # no reader any more: the test is gone
        fd = os.open(gate / "done", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            os.write(fd, b".")
        finally:
            os.close(fd)


State = dict[str, Any]
MAX_STATE_BYTES = 16 << 20  # far above a busy simulated machine's state (a few hundred KiB)
_INT_MAX = 1 << 63

# key -> (type, required) of each object in a state document
_Shape = dict[str, tuple[str, bool]]
_TOP: _Shape = {"version": ("int", True), "machine": ("str", True), "boot": ("int", True),
                "serial": ("int", True), "event_seq": ("int", True), "events": ("list", True),
                "fail_next": ("list", True), "gpus": ("list", True)}
_GPU: _Shape = {"mig_current": ("bool", True), "mig_pending": ("bool", True), "lost": ("bool", True),
                "gis": ("list", True), "processes": ("list", True), "clients": ("list", False),
                "compute_mode": ("int", False), "persistence_mode": ("int", False),
                "cc_mode": ("str", False), "cc_pending": ("str", False), "ppcie": ("bool", False),
                "ppcie_pending": ("bool", False), "cc_ready": ("int", False), "drain": ("int", False),
                "recovery_action": ("int", False), "driver": ("str", False)}
_GI: _Shape = {"id": ("int", True), "profile_id": ("int", True), "start": ("int", True), "size": ("int", True),
               "serial": ("int", False), "cis": ("list", True)}
_CI: _Shape = {"id": ("int", True), "profile_id": ("int", True), "slices": ("int", True), "start": ("int", True),
               "serial": ("int", False)}
_PROCESS: _Shape = {"pid": ("int", True), "name": ("str", True), "used_mib": ("int", True),
                    "gi_id": ("int?", False)}
_EVENT: _Shape = {"seq": ("int", True), "gpu": ("int", True), "type": ("int", True), "data": ("int", True),
                  "gi_id": ("int?", False), "ci_id": ("int?", False)}
_FAIL: _Shape = {"function": ("str", True), "code": ("int", True), "count": ("int", True), "after": ("int", False)}


def _check(obj: Any, shape: _Shape, where: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be an object, not {shown(obj)}")
    for key, (kind, required) in shape.items():
        if key not in obj:
            if required:
                raise ValueError(f"{where} lacks {key!r}")
            continue
        value = obj[key]
        if kind in ("int", "int?"):
            ok = (value is None and kind == "int?") or (
                isinstance(value, int) and not isinstance(value, bool) and -_INT_MAX <= value < _INT_MAX)
        else:
            ok = isinstance(value, {"str": str, "bool": bool, "list": list}[kind])
        if not ok:
            raise ValueError(f"{where}.{key} must be {'an integer' if kind.startswith('int') else 'a ' + kind}, "
                             f"not {shown(value)}")


def check_state(doc: Any, machine: SimMachine | None) -> None:
    """Raise ``ValueError`` (one line) unless ``doc`` is a state document of this simulator (and, with
    ``machine``, of that machine): every key the simulator reads is there with its type."""
    _check(doc, _TOP, "the state")
    if doc["version"] != STATE_VERSION:
        raise ValueError(f"unknown format version {shown(doc['version'])}")
    if machine is not None and doc["machine"] != machine.name:
        raise ValueError(f"it belongs to machine {shown(doc['machine'])}, not {machine.name!r}")
    if machine is not None and len(doc["gpus"]) != len(machine.gpus):
        raise ValueError(f"it has {len(doc['gpus'])} GPUs, machine {machine.name!r} has {len(machine.gpus)}")
    for i, gs in enumerate(doc["gpus"]):
        _check(gs, _GPU, f"gpus[{i}]")
        for j, gi in enumerate(gs["gis"]):
            _check(gi, _GI, f"gpus[{i}].gis[{j}]")
            for k, ci in enumerate(gi["cis"]):
                _check(ci, _CI, f"gpus[{i}].gis[{j}].cis[{k}]")
        for j, proc in enumerate(gs["processes"]):
            _check(proc, _PROCESS, f"gpus[{i}].processes[{j}]")
    for i, ev in enumerate(doc["events"]):
        _check(ev, _EVENT, f"events[{i}]")
    for i, f in enumerate(doc["fail_next"]):
        _check(f, _FAIL, f"fail_next[{i}]")


def _parse(path: Path, raw: bytes, machine: SimMachine | None) -> State:
    """The checked state document in ``raw``; ``InputError`` in one line naming the file otherwise."""
    try:
        doc = json.loads(raw)
        check_state(doc, machine)
    except RecursionError:
        raise InputError(f"sim-state file {path} is unreadable: nested too deeply", subject=str(path)) from None
    except ValueError as e:  # JSON syntax, an integer beyond the digit limit, a wrong type
        raise InputError(f"sim-state file {path} is unreadable: {str(e)[:200]}", subject=str(path)) from None
    state: State = doc
    return state


def _read_file(path: Path) -> bytes | None:
    try:
        return read_regular(path, max_bytes=MAX_STATE_BYTES)  # a FIFO or /dev/zero is refused, never read
    except UnreadableFileError as e:
        raise InputError(f"sim-state file {e}", subject=str(path)) from None


def initial_state(machine: SimMachine) -> State:
    """A freshly booted machine: MIG off everywhere, no instances, no processes, no faults."""
    return {
        "version": STATE_VERSION,
        "machine": machine.name,
        "boot": 1,
        "serial": 0,  # counter behind MIG UUIDs, so re-created instances get new ones
        "event_seq": 0,
        "events": [],
        "fail_next": [],
        "gpus": [
            {"mig_current": False, "mig_pending": False, "lost": False, "gis": [], "processes": []}
            for _ in machine.gpus
        ],
    }


def read_state_machine_name(path: Path) -> str | None:
    """The machine recorded in an existing sim-state file, or None if the file does not exist."""
    raw = _read_file(path)
    if raw is None:
        return None
    name: str = _parse(path, raw, None)["machine"]
    return name


class SimStore:
    """Holds the state in memory or in a file shared between processes."""

    def __init__(self, machine: SimMachine, path: Path | None = None) -> None:
        self.machine = machine
        self.path = path
        self._lock = threading.RLock()
        self._stamp: tuple[int, int, int] | None = None
        self._raw = b""  # the file's bytes as last parsed or written
        self._state: State = initial_state(machine)
        self._generation = 0  # bumped by this process's transactions and by changes seen on the file
        self._changed = threading.Condition(threading.Lock())
        self._watch: FileWatch | None = None  # inotify on the file's directory, made on first wait
        self._watch_failed = False
        self._polling = False  # one waiter at a time blocks on the watch, the others on _changed
        if path is not None:
            with self.transaction():
                pass  # creates the file on first use, validates an existing one

    @classmethod
    def open(cls, machine_name: str | None, path: Path | None) -> SimStore:
        """Open a store; the machine comes from ``machine_name`` or, failing that, the existing file."""
        recorded = read_state_machine_name(path) if path is not None else None
        if machine_name is None:
            if recorded is None:
                raise InputError(
                    f"sim-state file {path} does not exist yet; name the machine with --simulate MACHINE"
                    if path is not None
                    else "no simulated machine given; use --simulate MACHINE"
                )
            machine_name = recorded
        elif recorded is not None and recorded != machine_name:
            raise InputError(
                f"sim-state file {path} belongs to machine {shown(recorded)}, not {shown(machine_name)}",
                subject=str(path),
            )
        return cls(load_machine(machine_name), path)

    # --- file plumbing ------------------------------------------------------------------------
    def _file_stamp(self) -> tuple[int, int, int] | None:
        assert self.path is not None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _load_file(self) -> None:
        assert self.path is not None
        stamp = self._file_stamp()
        if stamp is None:
            self._state = initial_state(self.machine)
            self._stamp = None
            self._raw = b""
            return
        # Inodes get reused and mtimes come from a coarse clock, so a file changed within the last second
        # is re-read even when its identity looks unchanged; it is parsed again only when its bytes differ
        # (a rediscovery right after a MIG change makes hundreds of calls while the file is that young).
        if stamp == self._stamp and (time.time_ns() - stamp[2] > 1_000_000_000 or self._holds_parsed_bytes()):
            return
        raw_or_none = _read_file(self.path)
        if raw_or_none is None:
            self._state = initial_state(self.machine)
            self._stamp = None
            self._raw = b""
            return
        raw = raw_or_none
        if stamp == self._stamp and raw == self._raw:
            return
        doc = _parse(self.path, raw, self.machine)
        self._state = doc
        self._stamp = stamp
        self._raw = raw

    def _holds_parsed_bytes(self) -> bool:
        """Whether the file still holds exactly the bytes parsed last: one open and one bounded read, for the
        calls that come while the file is young. Anything unusual (a short read, a path swapped for a FIFO or a
        device) answers False, and the caller's full read judges it."""
        assert self.path is not None
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            return os.read(fd, len(self._raw) + 1) == self._raw
        except OSError:
            return False
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        assert self.path is not None
        fd = os.open(self.path.absolute().parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    # --- public API ---------------------------------------------------------------------------
    def read(self) -> State:
        """The current state (re-read when another process changed the file). Do not mutate it."""
        with self._lock:
            if self.path is not None:
                self._load_file()
            return self._state

    @contextlib.contextmanager
    def transaction(self) -> Iterator[State]:
        """Change the state: yields a copy; on normal exit it becomes the new state (and the file)."""
        with self._lock:
            if self.path is None:
                work = copy.deepcopy(self._state)
                yield work
                self._state = work
                self._bump()
                return
            with self._file_lock():
                self._load_file()
                work = copy.deepcopy(self._state)
                yield work
                data = (json.dumps(work, indent=1, sort_keys=True) + "\n").encode()
                if data != self._raw:  # an unchanged state (e.g. opening the store) leaves the file alone
                    gate = _step_gate()
                    if gate is not None:
                        _await_step(gate)
                    atomic_write(self.path, data, backup=False)
                    self._stamp = self._file_stamp()
                    self._raw = data
                    if gate is not None:
                        _step_done(gate)
                self._state = work
            self._bump()

    def _bump(self) -> None:
        with self._changed:
            self._generation += 1
            self._changed.notify_all()

    def change_marker(self) -> int:
        """A marker for "now", to pass to ``wait_change``; take it before reading the state the wait is
        about, so a change in between is not missed. Starts watching the file on first use."""
        with self._changed:
            if self.path is not None and self._watch is None and not self._watch_failed:
                try:
                    watch = FileWatch(self.path)
                except OSError as e:  # no inotify here, or the per-user instance limit is reached
                    log.debug("cannot watch %s (%s); polling it every %.2fs", self.path, e, FALLBACK_POLL_S)
                    self._watch_failed = True
                else:
                    self._watch = watch
                    weakref.finalize(self, watch.close)
            return self._generation

    def wait_change(self, seen: int, timeout_s: float) -> int:
        """Block until the state may have changed since ``seen`` (from ``change_marker``) or ``timeout_s``
        passed; returns the new marker (equal to ``seen`` on a quiet timeout). Spurious wake-ups happen:
        re-read and check. Several threads may wait at once: one polls the inotify descriptor, the others
        sleep on a condition variable it signals. Without inotify this sleeps ``FALLBACK_POLL_S`` at most,
        so callers look at the file that often."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._changed:
            while self._generation == seen:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                watch = self._watch
                if self.path is not None and watch is None:
                    self._changed.release()  # fallback: a slow poll; the caller re-reads the file anyway
                    try:
                        time.sleep(min(FALLBACK_POLL_S, remaining))
                    finally:
                        self._changed.acquire()
                    break
                if watch is None or self._polling:
                    self._changed.wait(remaining)
                    continue
                self._polling = True
                self._changed.release()
                try:
                    changed = watch.wait(remaining)
                finally:
                    self._changed.acquire()
                    self._polling = False
                if changed:
                    self._generation += 1
                self._changed.notify_all()  # hand the descriptor to another waiter, or wake it with news
            return self._generation
