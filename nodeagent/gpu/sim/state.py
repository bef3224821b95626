"""The simulator's mutable state: MIG modes, instances, processes, faults and events.

The state is a JSON document. With a file it outlives processes like hardware state does: every change
happens under an exclusive ``flock`` on ``<file>.lock``, re-reads the file first and replaces it
atomically, so a test or ``nodeagent sim inject`` can change it under a running daemon. Readers notice
such changes by the file's identity (inode, size, mtime). Without a file the state lives in memory.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nodeagent.errors import InputError
from nodeagent.fileio import atomic_write
from nodeagent.gpu.sim.machine import SimMachine, load_machine

STATE_VERSION = 1
MAX_EVENTS = 256

State = dict[str, Any]


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
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise InputError(f"sim-state file {path} is unreadable: {e}", subject=str(path)) from e
    name = doc.get("machine") if isinstance(doc, dict) else None
    if not isinstance(name, str):
        raise InputError(f"sim-state file {path} names no machine", subject=str(path))
    return name


class SimStore:
    """Holds the state in memory or in a file shared between processes."""

    def __init__(self, machine: SimMachine, path: Path | None = None) -> None:
        self.machine = machine
        self.path = path
        self._lock = threading.RLock()
        self._stamp: tuple[int, int, int] | None = None
        self._state: State = initial_state(machine)
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
                f"sim-state file {path} belongs to machine {recorded!r}, not {machine_name!r}",
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
            return
        # Inodes get reused and mtimes come from a coarse clock, so a file changed within the last second
        # is re-read even when its identity looks unchanged.
        if stamp == self._stamp and time.time_ns() - stamp[2] > 1_000_000_000:
            return
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            raise InputError(f"sim-state file {self.path} is unreadable: {e}", subject=str(self.path)) from e
        if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
            raise InputError(f"sim-state file {self.path} has an unknown format", subject=str(self.path))
        if doc.get("machine") != self.machine.name or len(doc.get("gpus", ())) != len(self.machine.gpus):
            raise InputError(
                f"sim-state file {self.path} belongs to machine {doc.get('machine')!r}, "
                f"not {self.machine.name!r}",
                subject=str(self.path),
            )
        self._state = doc
        self._stamp = stamp

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        assert self.path is not None
        lock_path = self.path.with_name(self.path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
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
                return
            with self._file_lock():
                self._load_file()
                work = copy.deepcopy(self._state)
                yield work
                atomic_write(self.path, json.dumps(work, indent=1, sort_keys=True) + "\n", backup=False)
                self._state = work
                self._stamp = self._file_stamp()
