"""The host-managed ``nvidia-imex`` daemon, run and supervised by the agent (the one adapter that executes
``nvidia-imex`` and ``nvidia-imex-ctl``).

``set_peers(addresses)`` is the whole interface for membership: the addresses (this node's included) are
written atomically to the nodes file; a running daemon is told with SIGUSR1 to read it again, so a healthy
domain is not torn down for a node joining or leaving; with no peer at all the daemon is stopped. The config
file is written before each start with the keys of ``daemonconfig``. The daemon runs in the foreground
(``DAEMONIZE=0``) as the agent's child; when it exits unasked it is started again with back-off. Readiness is
``nvidia-imex-ctl -q`` answering exactly ``READY`` (what NVIDIA's DRA driver checks), polled every
``poll_s``; each change of readiness, pid or peers calls ``on_change`` (conditions, labels, metrics).

What is executed is the node's driver's binaries (``<driver root>/usr/bin/nvidia-imex``), or under
``--simulate`` the simulator's stand-ins (``python -m nodeagent.simulator.imex_daemon``): never a file of a
sandbox root. Files under the root are resolved inside it when written; the config names them as this
process sees them, so the daemon (a child of this process) finds them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nodeagent import fileio
from nodeagent.backoff import Backoff
from nodeagent.deadline import within
from nodeagent.hostpaths import HostPaths
from nodeagent.imex import daemonconfig
from nodeagent.imex.daemonconfig import DaemonSettings

log = logging.getLogger(__name__)

DAEMON_BINARY = "/usr/bin/nvidia-imex"
CTL_BINARY = "/usr/bin/nvidia-imex-ctl"
STAND_IN_DAEMON = (sys.executable, "-m", "nodeagent.simulator.imex_daemon")
STAND_IN_CTL = (sys.executable, "-m", "nodeagent.simulator.imex_ctl")
POLL_S = 1.0
QUERY_TIMEOUT_S = 5.0
STOP_GRACE_S = 3.0
RESTART_START_S = 0.2
RESTART_MAX_S = 10.0
SAFE_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class ImexState:
    """What the supervisor knows now (read by conditions, labels, metrics and ``doctor``)."""

    peers: tuple[str, ...] = ()
    pid: int | None = None
    ready: bool = False
    answer: str = ""  # the last ``nvidia-imex-ctl -q`` answer, or why there was none
    restarts: int = 0
    last_error: str = ""
    since: float = field(default_factory=time.time)


class ImexSupervisor:
    def __init__(self, paths: HostPaths, settings: DaemonSettings, *, daemon: Sequence[str], ctl: Sequence[str],
                 config_path: str = daemonconfig.CONFIG_PATH, on_change: Callable[[], Awaitable[None]] | None = None,
                 poll_s: float = POLL_S) -> None:
        self.paths = paths
        self._config = paths(config_path)
        self._nodes = paths(settings.nodes_file)
        # the config names the files as this process (and its child, the daemon) sees them
        self.settings = DaemonSettings(
            bind_ip=settings.bind_ip, server_port=settings.server_port, cmd_port=settings.cmd_port,
            nodes_file=str(self._nodes), control_socket=str(paths(settings.control_socket)),
            log_file=settings.log_file)
        self._daemon = tuple(daemon)
        self._ctl = tuple(ctl)
        self._on_change = on_change
        self._poll_s = poll_s
        self.state = ImexState()
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._poller: asyncio.Task[None] | None = None
        self._stopping = False

    @classmethod
    def for_node(cls, paths: HostPaths, settings: DaemonSettings, *, simulate: bool, driver_root: str = "/",
                 on_change: Callable[[], Awaitable[None]] | None = None, poll_s: float = POLL_S) -> ImexSupervisor:
        """The driver's binaries (under the driver root, on the node's root only) or the stand-ins."""
        daemon: tuple[str, ...]
        ctl: tuple[str, ...]
        if simulate or not paths.is_node_root:
            daemon, ctl = STAND_IN_DAEMON, STAND_IN_CTL
        else:
            root = paths(driver_root)
            daemon, ctl = (str(root / DAEMON_BINARY.lstrip("/")),), (str(root / CTL_BINARY.lstrip("/")),)
        return cls(paths, settings, daemon=daemon, ctl=ctl, on_change=on_change, poll_s=poll_s)

    # --- membership -----------------------------------------------------------------------------
    async def set_peers(self, addresses: Sequence[str]) -> None:
        """The domain's members (this node's address included); starts, signals or stops the daemon."""
        peers = tuple(daemonconfig.parse_nodes(daemonconfig.render_nodes(addresses)))
        if peers == self.state.peers and (self._task is not None) == bool(peers):
            return
        change = daemonconfig.membership_change(self.state.peers, peers)
        self.state.peers = peers
        if not peers:
            await self.stop()
            await self._changed()
            return
        fileio.makedirs(self._nodes.parent, root=self.paths)
        fileio.atomic_write(self.paths.within(self._nodes), daemonconfig.render_nodes(peers), mode=0o644,
                            backup=False)
        proc = self._proc
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._supervise(), name="imex daemon")
            self._poller = asyncio.create_task(self._poll(), name="imex readiness")
        elif proc is not None and proc.returncode is None and change.changed:
            log.info("IMEX domain membership changed (+%s -%s): the daemon reads its nodes file again",
                     ",".join(change.added) or "none", ",".join(change.removed) or "none")
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)
        await self._changed()

    # --- the daemon -----------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        env = {"PATH": SAFE_PATH}
        for key in ("LD_LIBRARY_PATH", "PYTHONPATH"):
            if os.environ.get(key):
                env[key] = os.environ[key]
        return env

    def _write_config(self) -> None:
        fileio.makedirs(self._config.parent, root=self.paths)
        fileio.atomic_write(self.paths.within(self._config), daemonconfig.render_config(self.settings),
                            mode=0o644, backup=False)

    async def _supervise(self) -> None:
        backoff = Backoff(RESTART_START_S, RESTART_MAX_S, jitter=False)
        while not self._stopping:
            try:
                self._write_config()
                proc = await asyncio.create_subprocess_exec(
                    *self._daemon, "-c", str(self.paths.within(self._config)), stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL, stderr=None, env=self._env(), start_new_session=True)
            except OSError as e:
                self.state.last_error = f"cannot run {self._daemon[-1]}: {e.strerror or e}"
                log.error("IMEX daemon: %s", self.state.last_error)
                await asyncio.sleep(backoff.next())
                continue
            self._proc = proc
            self.state.pid = proc.pid
            log.info("IMEX daemon started (pid %d, %d nodes)", proc.pid, len(self.state.peers))
            await self._changed()
            started = time.monotonic()
            code = await proc.wait()
            self.state.pid, self.state.ready = None, False
            if self._stopping:
                return
            self.state.last_error = f"exited with status {code}"
            log.warning("IMEX daemon exited (status %s); restarting", code)
            await self._changed()
            if time.monotonic() - started > RESTART_MAX_S:
                backoff.reset()
            await asyncio.sleep(backoff.next())
            self.state.restarts += 1

    async def query(self) -> str:
        """``nvidia-imex-ctl -c CONFIG -q``: its one line, or raises OSError/TimeoutError."""
        proc = await asyncio.create_subprocess_exec(
            *self._ctl, "-c", str(self.paths.within(self._config)), "-q", stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=self._env(),
            start_new_session=True)
        try:
            out, err = await within(proc.communicate(), QUERY_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            why = (err.decode(errors="replace").strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            raise OSError(why)
        return out.decode(errors="replace")

    async def _poll(self) -> None:
        while not self._stopping:
            if self.state.pid is not None:
                try:
                    answer = await self.query()
                    ready, text = answer == daemonconfig.READY + "\n", answer.strip()
                except (OSError, TimeoutError) as e:
                    ready, text = False, f"nvidia-imex-ctl: {e or 'no answer'}"
                if (ready, text) != (self.state.ready, self.state.answer):
                    self.state.ready, self.state.answer = ready, text
                    self.state.since = time.time()
                    log.info("IMEX domain %s (%s)", "ready" if ready else "not ready", text)
                    await self._changed()
            await asyncio.sleep(self._poll_s)

    async def _changed(self) -> None:
        if self._on_change is not None:
            try:
                await self._on_change()
            except Exception:  # a listener's failure must not stop supervision
                log.exception("IMEX state listener failed")

    async def stop(self) -> None:
        """Stop the daemon (SIGTERM, then SIGKILL) and its supervision; nothing is left running."""
        self._stopping = True
        for task in (self._poller, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._poller = None
        proc = self._proc
        if proc is not None and proc.returncode is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)
                try:
                    await within(proc.wait(), STOP_GRACE_S)
                    break
                except TimeoutError:
                    continue
        self._proc = None
        self.state.pid, self.state.ready = None, False
        self.state.answer = "stopped"


def nodes_file(paths: HostPaths, settings: DaemonSettings) -> Path:
    return paths(settings.nodes_file)
