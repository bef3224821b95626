"""The IMEX supervisor with two real stand-in daemons talking TCP on 127.0.0.2 and 127.0.0.3: both READY only
when each answers the other; a killed daemon is restarted; a stopped (partitioned) daemon makes its peer
NOT_READY; a node that leaves shrinks the other's nodes file without restarting its daemon."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from nodeagent.hostpaths import HostPaths
from nodeagent.imex.daemonconfig import DaemonSettings, parse_nodes
from nodeagent.imex.supervisor import ImexSupervisor
from tests.peers._ports import free_port

A, B = "127.0.0.2", "127.0.0.3"


async def _until(what: str, cond: Callable[[], bool], timeout: float = 40.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.05)


def _supervisor(tmp_path: Path, name: str, ip: str, port: int, cmd_port: int) -> ImexSupervisor:
    root = tmp_path / name
    root.mkdir()
    settings = DaemonSettings(bind_ip=ip, server_port=port, cmd_port=cmd_port)
    return ImexSupervisor.for_node(HostPaths(root), settings, simulate=True, poll_s=0.1)


def test_two_daemons_ready_restart_partition_leave(tmp_path: Path) -> None:
    port, cmd_port = free_port(A), free_port(A)

    async def scenario() -> None:
        a = _supervisor(tmp_path, "a", A, port, cmd_port)
        b = _supervisor(tmp_path, "b", B, port, cmd_port)
        try:
            await a.set_peers([B, A])
            await _until("a alone is not ready while b is absent", lambda: a.state.answer == "NOT_READY")
            assert not a.state.ready
            await b.set_peers([A, B])
            await _until("both ready", lambda: a.state.ready and b.state.ready)
            assert parse_nodes((tmp_path / "a/etc/nvidia-imex/nodes_config.cfg").read_text()) == [A, B]
            assert "IMEX_CMD_UNIX_DOMAIN_PATH=" + str(tmp_path / "b/etc/nvidia-imex/imex_ctrl.sock") in \
                (tmp_path / "b/etc/nvidia-imex/config.cfg").read_text()

            # b's daemon dies: b's supervisor starts it again (a's not-ready gap may be shorter than its poll),
            # both ready again
            dead = b.state.pid
            assert dead is not None
            os.kill(dead, signal.SIGKILL)
            await _until("b restarted and both ready", lambda: b.state.pid not in (None, dead)
                         and a.state.ready and b.state.ready)
            assert b.state.restarts == 1

            # b partitioned (its daemon stopped: connections hang): a goes NOT_READY, then back
            pid = b.state.pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            try:
                await _until("a not ready while b is partitioned", lambda: not a.state.ready)
            finally:
                os.kill(pid, signal.SIGCONT)
            await _until("ready after the partition healed", lambda: a.state.ready and b.state.ready)

            # b leaves: its daemon stops; a's list shrinks and its daemon (the same process) is ready alone
            a_pid = a.state.pid
            await b.set_peers([])
            assert b.state.pid is None
            await _until("a not ready without b", lambda: not a.state.ready)
            await a.set_peers([A])
            await _until("a ready alone", lambda: a.state.ready)
            assert a.state.pid == a_pid and a.state.restarts == 0
            assert parse_nodes((tmp_path / "a/etc/nvidia-imex/nodes_config.cfg").read_text()) == [A]
        finally:
            await a.stop()
            await b.stop()
        assert a.state.pid is None and b.state.pid is None

    asyncio.run(scenario())
