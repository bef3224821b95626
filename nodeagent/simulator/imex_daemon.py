"""Stand-in for ``nvidia-imex``: ``python -m nodeagent.simulator.imex_daemon -c CONFIG``.

It reads the daemon's config keys as NVIDIA's daemon does (``KEY=value``), listens for its peers on
``BIND_INTERFACE_IP:SERVER_PORT`` and for commands on ``IMEX_CMD_UNIX_DOMAIN_PATH`` and (with
``IMEX_CMD_ENABLED=1``) ``IMEX_CMD_BIND_INTERFACE_IP:IMEX_CMD_PORT`` — only on the addresses configured, never
a wildcard. Every ``PROBE_S`` it greets every address of the nodes file (``IMEX_NODE_CONFIG_FILE``) on
``SERVER_PORT`` over TCP; the domain is READY only when every one of them, itself included, answered the
last round within ``PEER_TIMEOUT_S``. So a node that leaves (its daemon gone: refused), a daemon that dies
and a partitioned node (a stopped daemon: the greeting times out) show as they would. SIGUSR1 (and SIGHUP)
reads the nodes file again without a restart, as NVIDIA's daemon does in DNS-name mode; SIGTERM ends it.

The wire protocol is this simulator's own (one line each way): ``IMEX-PEER <addr>`` → ``IMEX-PEER-OK <addr>``
between daemons, ``QUERY`` → ``READY``/``NOT_READY`` and ``NODES`` → one JSON line for ``imex_ctl``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

from nodeagent.imex.daemonconfig import parse_config, parse_nodes

PROBE_S = 0.25
PEER_TIMEOUT_S = 0.5
MAX_LINE = 4096


class Daemon:
    def __init__(self, keys: dict[str, str]) -> None:
        self.keys = keys
        self.bind_ip = keys.get("BIND_INTERFACE_IP", "")
        self.port = int(keys.get("SERVER_PORT", "50000"))
        self.nodes_file = keys.get("IMEX_NODE_CONFIG_FILE", "")
        self.nodes: list[str] = []
        self.answered: dict[str, bool] = {}
        self.rounds = 0
        self.reload = asyncio.Event()
        self.stop = asyncio.Event()

    def read_nodes(self) -> None:
        try:
            self.nodes = parse_nodes(Path(self.nodes_file).read_text())
        except OSError as e:
            print(f"nvidia-imex (stand-in): cannot read nodes file {self.nodes_file}: {e.strerror}", file=sys.stderr)
            self.nodes = []
        self.answered = {a: self.answered.get(a, False) for a in self.nodes}
        self.rounds = 0  # readiness is judged on a full round against the new list
        print(f"nvidia-imex (stand-in): nodes {', '.join(self.nodes) or '(none)'}", file=sys.stderr, flush=True)

    @property
    def ready(self) -> bool:
        return self.rounds > 0 and bool(self.nodes) and all(self.answered.get(a, False) for a in self.nodes)

    async def greet(self, address: str) -> bool:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(address, self.port), PEER_TIMEOUT_S)
        except (OSError, TimeoutError):
            return False
        try:
            writer.write(f"IMEX-PEER {self.bind_ip}\n".encode())
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), PEER_TIMEOUT_S)
            return line.decode(errors="replace").split() == ["IMEX-PEER-OK", address]
        except (OSError, TimeoutError):
            return False
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def probe_loop(self) -> None:
        while not self.stop.is_set():
            if self.reload.is_set():
                self.reload.clear()
                self.read_nodes()
            nodes = list(self.nodes)
            results = await asyncio.gather(*(self.greet(a) for a in nodes))
            if nodes == self.nodes:  # not a list read again meanwhile
                before = self.ready
                self.answered = dict(zip(nodes, results, strict=True))
                self.rounds += 1
                if before != self.ready:
                    print(f"nvidia-imex (stand-in): {'READY' if self.ready else 'NOT_READY'} "
                          f"({sum(results)}/{len(nodes)} nodes answer)", file=sys.stderr, flush=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), PROBE_S)

    async def on_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), PEER_TIMEOUT_S * 4)
            if line.startswith(b"IMEX-PEER "):
                writer.write(f"IMEX-PEER-OK {self.bind_ip}\n".encode())
                await writer.drain()
        except (OSError, TimeoutError):
            pass
        finally:
            writer.close()

    async def on_command(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = (await asyncio.wait_for(reader.readline(), 5.0)).decode(errors="replace").strip()
            if line == "QUERY":
                answer = "READY" if self.ready else "NOT_READY"
            elif line == "NODES":
                answer = json.dumps({"ready": self.ready, "nodes": [
                    {"address": a, "status": "READY" if self.answered.get(a) else "UNAVAILABLE"}
                    for a in self.nodes]})
            else:
                answer = "ERROR unknown command"
            writer.write((answer + "\n").encode())
            await writer.drain()
        except (OSError, TimeoutError):
            pass
        finally:
            writer.close()


async def serve(keys: dict[str, str]) -> int:
    d = Daemon(keys)
    if not d.bind_ip:
        print("nvidia-imex (stand-in): BIND_INTERFACE_IP is empty; this stand-in binds only to a configured "
              "address", file=sys.stderr)
        return 1
    d.read_nodes()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGUSR1, signal.SIGHUP):
        loop.add_signal_handler(sig, d.reload.set)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, d.stop.set)
    servers = [await asyncio.start_server(d.on_peer, d.bind_ip, d.port, reuse_address=True)]
    sock = keys.get("IMEX_CMD_UNIX_DOMAIN_PATH", "")
    if sock:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock)
        servers.append(await asyncio.start_unix_server(d.on_command, sock))
    cmd_ip = keys.get("IMEX_CMD_BIND_INTERFACE_IP", "")
    if keys.get("IMEX_CMD_ENABLED") == "1" and cmd_ip:
        servers.append(await asyncio.start_server(d.on_command, cmd_ip, int(keys.get("IMEX_CMD_PORT", "50005")),
                                                  reuse_address=True))
    print(f"nvidia-imex (stand-in): listening on {d.bind_ip}:{d.port}", file=sys.stderr, flush=True)
    try:
        await d.probe_loop()
    finally:
        for s in servers:
            s.close()
        if sock:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(sock)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nvidia-imex", description="nodeagent's stand-in for nvidia-imex")
    parser.add_argument("-c", "--config", required=True, help="the daemon's config file")
    args = parser.parse_args(argv)
    try:
        keys = parse_config(Path(args.config).read_text())
    except OSError as e:
        print(f"nvidia-imex (stand-in): cannot read {args.config}: {e.strerror}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(serve(keys))
    except OSError as e:
        print(f"nvidia-imex (stand-in): {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
