"""MPS control daemons run and supervised by the agent (the one adapter that executes ``nvidia-cuda-mps-control``).

Each ``MpsDaemonSpec`` becomes one ``nvidia-cuda-mps-control -f`` child of the agent (``-f``: in the
foreground, so it stays the agent's child and its exit is seen at once) with its own pipe and log
directories and ``CUDA_VISIBLE_DEVICES``. Once it answers on its control channel the defaults are sent
(``set_default_active_thread_percentage``, ``set_default_device_pinned_mem_limit`` per device) and the
daemon is *ready*. When it exits unasked it is started again with back-off, not ready meanwhile; ``stop``
sends ``quit`` (then SIGTERM, then SIGKILL) and waits for the exit. Commands go through the binary itself
in client mode, one process per batch of commands, as NVIDIA's tools do.

Like NVIDIA's MPS control daemon (``nvidia-smi -c EXCLUSIVE_PROCESS`` before it starts the daemon, ``-c
DEFAULT`` after ``quit``), the manager switches the GPUs its daemons serve from DEFAULT to EXCLUSIVE_PROCESS,
so that no process reaches them without going through the MPS server, and back to DEFAULT when no daemon
serves them any more. Only GPUs in DEFAULT are switched (an administrator's PROHIBITED stays, and the daemon
refuses it), and the GPUs switched are recorded under the run directory, so an agent killed before it could
switch them back has its successor do it; the driver itself resets the mode at reboot, when /run is emptied.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from nodeagent import fileio
from nodeagent.backoff import Backoff
from nodeagent.deadline import within
from nodeagent.errors import NodeAgentError

log = logging.getLogger(__name__)

CONTROL_BINARY = "/usr/bin/nvidia-cuda-mps-control"
READY_TIMEOUT_S = 10.0
COMMAND_TIMEOUT_S = 5.0
STOP_GRACE_S = 3.0
RESTART_START_S = 0.2
RESTART_MAX_S = 10.0
SAFE_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
# Where the daemons' pipe and log directories live on the node (one directory a daemon), the shared memory
# an MPS client and its server meet in, and the variable that tells a CUDA client its daemon's pipe directory.
MPS_RUN_DIR = "/run/nodeagent/mps"
SHM_DIR = "/dev/shm"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
# the GPUs a manager switched (a host path; one file per manager: the device plugin's and the DRA plane's
# serve disjoint GPUs, and each restores only its own)
COMPUTE_MODE_RECORD = MPS_RUN_DIR + "/exclusive-gpus-{owner}.json"
# NVML's compute modes (nvmlComputeMode_t)
COMPUTE_DEFAULT = 0
COMPUTE_EXCLUSIVE_PROCESS = 3


@runtime_checkable
class ComputeModes(Protocol):
    """The GPUs' compute mode (NVML; blocking calls, run in a thread)."""

    def compute_mode(self, uuid: str) -> int: ...

    def set_compute_mode(self, uuid: str, mode: int) -> None: ...


@dataclass(frozen=True)
class MpsDaemonSpec:
    """One control daemon: which GPUs, where its directories are, the defaults it must hold."""

    name: str  # what it serves (a resource name or a DRA claim), for messages and metrics
    pipe_dir: Path  # as the agent reaches it (under --root)
    log_dir: Path
    gpu_uuids: tuple[str, ...]
    thread_percentage: int  # default active thread percentage, 1..100
    pinned_limits: tuple[tuple[int, str], ...] = ()  # (CUDA device ordinal under CUDA_VISIBLE_DEVICES, "NNNM")

    def commands(self) -> list[str]:
        out = [f"set_default_device_pinned_mem_limit {dev} {limit}" for dev, limit in self.pinned_limits]
        out.append(f"set_default_active_thread_percentage {self.thread_percentage}")
        return out


@dataclass
class MpsDaemonState:
    """What metrics and ``discover`` show of one daemon."""

    name: str
    gpu_uuids: tuple[str, ...]
    pid: int | None = None
    ready: bool = False
    restarts: int = 0
    last_error: str = ""
    thread_percentage: int = 100
    pinned_limits: tuple[tuple[int, str], ...] = field(default_factory=tuple)


class MpsError(RuntimeError):
    pass


class MpsDaemon:
    """One supervised control daemon."""

    def __init__(self, spec: MpsDaemonSpec, binary: Path, *, extra_env: Mapping[str, str] | None = None,
                 on_change: Callable[[], Awaitable[None]] | None = None,
                 ready_timeout_s: float = READY_TIMEOUT_S, command: Sequence[str] | None = None,
                 root: fileio.Root | None = None) -> None:
        self.spec = spec
        self.binary = binary
        # what is executed: the driver's binary, or (``command``) the simulator's stand-in, never a file of a
        # sandbox root
        self._argv = tuple(command) if command else (str(binary),)
        self._root = root  # the pipe and log directories are resolved inside it at every start
        self._dirs = (spec.pipe_dir, spec.log_dir)
        self._extra_env = dict(extra_env or {})
        self._on_change = on_change
        self._ready_timeout = ready_timeout_s
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._first = asyncio.Event()  # set once the first start attempt has finished (ready or not)
        self.state = MpsDaemonState(spec.name, spec.gpu_uuids, thread_percentage=spec.thread_percentage,
                                    pinned_limits=spec.pinned_limits)

    @property
    def ready(self) -> bool:
        return self.state.ready

    def env(self) -> dict[str, str]:
        """The daemon's environment, built from nothing but: the driver's own binary directory first on the
        search path (where the control daemon finds ``nvidia-cuda-mps-server``, beside it), the agent's
        ``LD_LIBRARY_PATH`` (how the agent itself reaches the driver's libraries, e.g. the DaemonSet's links
        to the node's ``libnvidia-ml.so.1`` and ``libcuda.so.1``), the extra variables and MPS's own."""
        env = {"PATH": SAFE_PATH if self._argv[0] != str(self.binary) else f"{self.binary.parent}:{SAFE_PATH}"}
        library_path = os.environ.get("LD_LIBRARY_PATH")
        if library_path:
            env["LD_LIBRARY_PATH"] = library_path
        env.update(self._extra_env)
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self._dirs[0])
        env["CUDA_MPS_LOG_DIRECTORY"] = str(self._dirs[1])
        env["CUDA_VISIBLE_DEVICES"] = ",".join(self.spec.gpu_uuids)
        return env

    async def start(self) -> bool:
        """Start supervising; returns once the first start has answered (True) or failed (False)."""
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._supervise(), name=f"mps daemon {self.spec.name}")
        await self._first.wait()
        return self.ready

    async def command(self, lines: Sequence[str], timeout_s: float = COMMAND_TIMEOUT_S) -> str:
        """Send commands on the control channel (the binary in client mode); raises MpsError on failure."""
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=self.env(), start_new_session=True,
            )
        except OSError as e:
            raise MpsError(f"cannot run {self.binary}: {e.strerror or e}") from e
        try:
            out, err = await within(proc.communicate("".join(f"{x}\n" for x in lines).encode()), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise MpsError(f"{self.binary}: no answer within {timeout_s:g} s") from None
        if proc.returncode != 0:
            why = (err.decode(errors="replace").strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            raise MpsError(why)
        return out.decode(errors="replace")

    async def _spawn(self) -> asyncio.subprocess.Process:
        try:
            # resolved (inside the root) and made now: a directory replaced by a link since the last start
            # leads nowhere outside; the child gets the directories as resolved
            self._dirs = (fileio.makedirs(self.spec.pipe_dir, root=self._root),
                          fileio.makedirs(self.spec.log_dir, root=self._root))
        except OSError as e:
            raise MpsError(f"cannot create {e.filename}: {e.strerror}") from e
        if (self._dirs[0] / "control").exists():
            # a daemon left by an agent that was killed: this pipe directory is ours, so it is told to quit
            with contextlib.suppress(MpsError):
                await self.command(["quit"])
                log.warning("MPS daemon for %s: a daemon left on %s was told to quit", self.spec.name,
                            self.spec.pipe_dir)
                for _ in range(60):
                    if not (self._dirs[0] / "control").exists():
                        break
                    await asyncio.sleep(0.05)
        try:
            return await asyncio.create_subprocess_exec(
                *self._argv, "-f", stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE, env=self.env(), start_new_session=True,
            )
        except OSError as e:
            raise MpsError(f"cannot run {self.binary}: {e.strerror or e}") from e

    async def _wait_answer(self, proc: asyncio.subprocess.Process) -> None:
        deadline = time.monotonic() + self._ready_timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                err = b""
                if proc.stderr is not None:
                    err = await proc.stderr.read()
                why = (err.decode(errors="replace").strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
                raise MpsError(f"the control daemon exited at start: {why}")
            if (self._dirs[0] / "control").exists():
                try:
                    await self.command(["get_default_active_thread_percentage"])
                    return
                except MpsError as e:
                    last = str(e)
            await asyncio.sleep(0.05)
        raise MpsError(f"the control daemon did not answer within {self._ready_timeout:g} s ({last})")

    async def _changed(self) -> None:
        if self._on_change is not None:
            await self._on_change()

    async def _supervise(self) -> None:
        try:
            await self._supervise_loop()
        finally:
            self._first.set()  # whatever ended the loop, nobody waits for the first start for ever

    async def _supervise_loop(self) -> None:
        backoff = Backoff(RESTART_START_S, RESTART_MAX_S, jitter=False)
        first = True
        while not self._stopping:
            proc: asyncio.subprocess.Process | None = None
            try:
                proc = await self._spawn()
                self._proc = proc
                self.state.pid = proc.pid
                await self._wait_answer(proc)
                await self.command(self.spec.commands())
            except MpsError as e:
                self.state.last_error = str(e)
                log.error("MPS daemon for %s: %s", self.spec.name, e)
                if proc is not None:
                    await self._end(proc)
                self.state.pid = None
                if first:
                    first = False
                    self._first.set()
                if self._stopping:
                    return
                await asyncio.sleep(backoff.next())
                self.state.restarts += 1
                continue
            self.state.ready, self.state.last_error = True, ""
            log.info("MPS daemon for %s ready (pid %d, GPUs %s, %d%% threads)", self.spec.name, proc.pid,
                     ",".join(self.spec.gpu_uuids), self.spec.thread_percentage)
            if first:
                first = False
                self._first.set()
            await self._changed()
            backoff.reset()
            code = await proc.wait()
            self.state.ready, self.state.pid = False, None
            if self._stopping:
                return
            self.state.last_error = f"exited with status {code}"
            log.warning("MPS daemon for %s exited (status %s); restarting", self.spec.name, code)
            await self._changed()
            await asyncio.sleep(backoff.next())
            self.state.restarts += 1

    async def _end(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)
            try:
                await within(proc.wait(), STOP_GRACE_S)
                return
            except TimeoutError:
                continue

    async def stop(self) -> None:
        """Quit the daemon and stop supervising it (nothing is left running)."""
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(MpsError):
                await self.command(["quit"])
            try:
                await within(proc.wait(), STOP_GRACE_S)
            except TimeoutError:
                await self._end(proc)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if proc is not None and proc.returncode is None:
            await self._end(proc)
        self.state.ready, self.state.pid = False, None


class MpsManager:
    """The set of daemons the current config asks for, started, swapped and stopped as it changes.

    ``install`` puts a stand-in binary in place the first time a daemon is wanted (tests); ``command``: what
    runs instead of ``binary`` (the simulator's stand-in, ``python -m nodeagent.simulator.mps_control``);
    ``root``: the directories and the record are resolved inside it at each use."""

    def __init__(self, binary: Path, *, extra_env: Mapping[str, str] | None = None,
                 on_change: Callable[[], Awaitable[None]] | None = None,
                 ready_timeout_s: float = READY_TIMEOUT_S,
                 install: Callable[[Path], object] | None = None,
                 compute_modes: ComputeModes | None = None, record: Path | None = None,
                 command: Sequence[str] | None = None, root: fileio.Root | None = None,
                 runnable: bool = True) -> None:
        self.binary = binary
        self._runnable = runnable  # False: the binary is a sandbox's file, which is never executed
        self._install = install
        self._command = tuple(command) if command else None
        self._root = root
        self._modes = compute_modes
        self._record = record  # where the GPUs switched to EXCLUSIVE_PROCESS are kept (None: not kept)
        self._extra_env = dict(extra_env or {})
        self.on_change = on_change  # called when a daemon becomes ready or dies
        self._ready_timeout = ready_timeout_s
        self._daemons: dict[str, MpsDaemon] = {}
        self._paused: dict[str, MpsDaemonSpec] = {}  # daemons stopped while a GPU of theirs is reset

    async def apply(self, specs: Mapping[str, MpsDaemonSpec]) -> None:
        """Stop the daemons no longer wanted (or wanted differently), start the new ones and wait for
        their first answer (a daemon that does not answer stays supervised and not ready)."""
        for name in [n for n, d in self._daemons.items() if specs.get(n) != d.spec]:
            await self._daemons.pop(name).stop()
        # a paused daemon stays stopped (as now wanted) until its GPU is resumed; one no longer wanted is forgotten
        self._paused = {n: specs[n] for n in self._paused if n in specs}
        wanted = {u for spec in specs.values() for u in spec.gpu_uuids}
        await self._compute_modes(wanted)
        if specs and self._command is None and self._install is not None and not self.binary.is_file():
            self._install(self.binary)
        started = []
        for name, spec in specs.items():
            if name not in self._daemons and name not in self._paused:
                daemon = MpsDaemon(spec, self.binary, extra_env=self._extra_env, on_change=self._changed,
                                   ready_timeout_s=self._ready_timeout, command=self._command, root=self._root)
                self._daemons[name] = daemon
                started.append(daemon.start())
        if started:
            await asyncio.gather(*started)

    async def _changed(self) -> None:
        if self.on_change is not None:
            await self.on_change()

    def _switched(self) -> set[str]:
        if self._record is None:
            return set()
        try:
            raw = json.loads(fileio.read_text(self._record, root=self._root) or "[]")
        except (OSError, ValueError, fileio.UnreadableFileError):
            return set()
        return {u for u in raw if isinstance(u, str)} if isinstance(raw, list) else set()

    def _keep(self, switched: set[str]) -> None:
        if self._record is None:
            return
        try:
            fileio.atomic_write(self._record, json.dumps(sorted(switched)) + "\n", mode=0o600, backup=False,
                                durable=False, root=self._root, parents=True)
        except OSError as e:
            log.warning("MPS: cannot record the GPUs in EXCLUSIVE_PROCESS in %s: %s", self._record, e.strerror or e)

    async def _compute_modes(self, wanted: set[str]) -> None:
        """GPUs served by a daemon: DEFAULT → EXCLUSIVE_PROCESS; GPUs switched earlier and served no more:
        back to DEFAULT. A GPU whose mode cannot be read or set keeps its mode (a warning; the daemon still
        starts: MPS works in DEFAULT too, without keeping other processes off the GPU)."""
        modes = self._modes
        if modes is None:
            return
        switched = self._switched()
        before = set(switched)
        for uuid in sorted(switched - wanted):
            try:
                if await asyncio.to_thread(modes.compute_mode, uuid) == COMPUTE_EXCLUSIVE_PROCESS:
                    await asyncio.to_thread(modes.set_compute_mode, uuid, COMPUTE_DEFAULT)
                    log.info("MPS: %s back to compute mode DEFAULT", uuid)
                switched.discard(uuid)
            except NodeAgentError as e:
                log.warning("MPS: %s: cannot set compute mode DEFAULT again: %s", uuid, e)
        for uuid in sorted(wanted - switched):
            try:
                mode = await asyncio.to_thread(modes.compute_mode, uuid)
                if mode != COMPUTE_DEFAULT:
                    continue  # EXCLUSIVE_PROCESS already, or an administrator's choice the daemon may refuse
                await asyncio.to_thread(modes.set_compute_mode, uuid, COMPUTE_EXCLUSIVE_PROCESS)
                switched.add(uuid)
                log.info("MPS: %s in compute mode EXCLUSIVE_PROCESS", uuid)
            except NodeAgentError as e:
                log.warning("MPS: %s: cannot set compute mode EXCLUSIVE_PROCESS (%s); its daemon runs in the "
                            "GPU's current mode", uuid, e)
        if switched != before:
            self._keep(switched)

    def available(self) -> bool:
        """Whether daemons can be run: the binary is there (or will be installed)."""
        return self.unavailable() == ""

    def unavailable(self) -> str:
        """Why no daemon can be run ("" when one can)."""
        if self._command is not None or self._install is not None:
            return ""
        if not self._runnable:
            return f"{self.binary} is a file of the sandbox root, which nodeagent never executes"
        if not self.binary.is_file():
            return f"{self.binary} does not exist (install the NVIDIA driver's compute utilities)"
        return ""

    def ready(self, name: str) -> bool:
        daemon = self._daemons.get(name)
        return daemon is not None and daemon.ready

    def daemon(self, name: str) -> MpsDaemon | None:
        return self._daemons.get(name)

    def states(self) -> list[MpsDaemonState]:
        return [d.state for d in self._daemons.values()]

    async def pause_gpu(self, uuid: str) -> list[str]:
        """Stop the daemons serving the GPU ``uuid`` (a GPU reset wants no process on it) until ``resume_gpu``;
        their names."""
        names = sorted(n for n, d in self._daemons.items() if uuid in d.spec.gpu_uuids)
        for name in names:
            daemon = self._daemons.pop(name)
            self._paused[name] = daemon.spec
            await daemon.stop()
        return names

    async def resume_gpu(self, uuid: str) -> list[str]:
        """Start again the daemons ``pause_gpu`` stopped for ``uuid`` (as the config now wants them); their
        names."""
        names = sorted(n for n, s in self._paused.items() if uuid in s.gpu_uuids)
        if names:
            specs = {n: d.spec for n, d in self._daemons.items()}
            specs.update({n: s for n, s in self._paused.items() if n not in names})
            for name in names:
                specs[name] = self._paused.pop(name)
            await self.apply(specs)
        return names

    def paused(self) -> list[str]:
        return sorted(self._paused)

    async def stop(self) -> None:
        self._paused.clear()
        await self.apply({})
