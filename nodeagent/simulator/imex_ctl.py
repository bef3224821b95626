"""Stand-in for ``nvidia-imex-ctl``: ``python -m nodeagent.simulator.imex_ctl [-c CONFIG] -q [--u=SOCKET]``.

``-q`` prints ``READY`` or ``NOT_READY`` (exactly one line) as the daemon answers; ``-N`` prints the nodes and
their status (``-j``: as JSON). The daemon is reached on ``--u`` or the config's ``IMEX_CMD_UNIX_DOMAIN_PATH``,
else on ``IMEX_CMD_BIND_INTERFACE_IP:IMEX_CMD_PORT``. A daemon that does not answer: a message on stderr and
exit status 1, nothing on stdout.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

from nodeagent.imex.daemonconfig import parse_config

TIMEOUT_S = 3.0


def ask(keys: dict[str, str], unix: str | None, command: str) -> str:
    path = unix or keys.get("IMEX_CMD_UNIX_DOMAIN_PATH", "")
    if path:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: object = path
    else:
        ip, port = keys.get("IMEX_CMD_BIND_INTERFACE_IP", ""), int(keys.get("IMEX_CMD_PORT", "50005"))
        s = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
        target = (ip, port)
    with s:
        s.settimeout(TIMEOUT_S)
        s.connect(target)  # type: ignore[arg-type]
        s.sendall(command.encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace").strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nvidia-imex-ctl", description="nodeagent's stand-in for nvidia-imex-ctl")
    parser.add_argument("-c", "--config", default="/etc/nvidia-imex/config.cfg")
    parser.add_argument("-q", action="store_true", help="print READY when the IMEX domain is ready")
    parser.add_argument("-N", action="store_true", help="the nodes and their status")
    parser.add_argument("-j", action="store_true", help="with -N: JSON")
    parser.add_argument("--u", dest="unix", default=None, help="the daemon's command socket")
    args = parser.parse_args(argv)
    keys: dict[str, str] = {}
    if args.unix is None:
        try:
            keys = parse_config(Path(args.config).read_text())
        except OSError as e:
            print(f"nvidia-imex-ctl (stand-in): cannot read {args.config}: {e.strerror}", file=sys.stderr)
            return 1
    try:
        if args.N:
            doc = json.loads(ask(keys, args.unix, "NODES"))
            if args.j:
                print(json.dumps(doc))
            else:
                for i, n in enumerate(doc["nodes"]):
                    print(f"Node #{i} - {n['address']} - {n['status']}")
                print("Domain State: " + ("UP" if doc["ready"] else "DEGRADED"))
            return 0
        print(ask(keys, args.unix, "QUERY"))
        return 0
    except (OSError, ValueError, KeyError) as e:
        print(f"nvidia-imex-ctl (stand-in): the IMEX daemon does not answer: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
