"""The host-managed ``nvidia-imex`` daemon's config file and nodes file (pure).

Keys are NVIDIA's (the ones its DRA driver sets for its daemons, REFERENCE §13.A2), with the host-managed
differences: the command service listens on a Unix socket (``IMEX_CMD_UNIX_DOMAIN_PATH``, which the DRA
driver's host-managed mode asks for) and on the node's own address, and the daemon stays in the foreground
under its supervisor. The nodes file lists one peer address a line: the InternalIPs of the Nodes that carry
the same ``nvidia.com/gpu.clique`` label, this node included, sorted so equal membership gives equal bytes.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from nodeagent.errors import ConfigError

CONFIG_PATH = "/etc/nvidia-imex/config.cfg"
NODES_PATH = "/etc/nvidia-imex/nodes_config.cfg"
CONTROL_SOCKET = "/etc/nvidia-imex/imex_ctrl.sock"
DEFAULT_SERVER_PORT = 50000
DEFAULT_CMD_PORT = 50005
READY = "READY"

_HEADER = "# written by nodeagent for the host-managed nvidia-imex daemon; rewritten when membership changes\n"


@dataclass(frozen=True)
class DaemonSettings:
    """What the node decides about its daemon (from nodeagent's ``[imex]`` config)."""

    bind_ip: str  # this node's InternalIP: the daemon binds here and is listed in the nodes file
    server_port: int = DEFAULT_SERVER_PORT
    cmd_port: int = DEFAULT_CMD_PORT
    nodes_file: str = NODES_PATH
    control_socket: str = CONTROL_SOCKET
    log_file: str = ""  # empty: stderr (the supervisor's log)


def check_address(value: str, what: str) -> str:
    """An IPv4/IPv6 address in its canonical text, or one ConfigError naming ``what``."""
    try:
        return str(ipaddress.ip_address(value.strip()))
    except ValueError:
        raise ConfigError(f"{what}: {value!r} is not an IP address", subject=what) from None


def check_port(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ConfigError(f"{what}: {value!r} is not a TCP port (1..65535)", subject=what)
    return value


def config_keys(settings: DaemonSettings) -> dict[str, str]:
    """The daemon's config keys, in the order they are written."""
    return {
        "SERVER_PORT": str(settings.server_port),
        "BIND_INTERFACE_IP": settings.bind_ip,
        "IMEX_NODE_CONFIG_FILE": settings.nodes_file,
        "IMEX_CMD_ENABLED": "1",
        "IMEX_CMD_PORT": str(settings.cmd_port),
        "IMEX_CMD_BIND_INTERFACE_IP": settings.bind_ip,
        "IMEX_CMD_UNIX_DOMAIN_PATH": settings.control_socket,
        "IMEX_WAIT_FOR_QUORUM": "RECOVERY",
        "IMEX_ENABLE_AUTH_ENCRYPTION": "0",
        "IMEX_NODE_DISCONNECTED_GRACE_TIME": "-1",
        "DAEMONIZE": "0",
        "LOG_FILE_NAME": settings.log_file,
    }


def render_config(settings: DaemonSettings) -> str:
    return _HEADER + "".join(f"{k}={v}\n" for k, v in config_keys(settings).items())


def parse_config(text: str) -> dict[str, str]:
    """``KEY=value`` lines (``#`` comments and blank lines skipped), as ``nvidia-imex`` reads its file."""
    out: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        out[key.strip()] = value.strip()
    return out


def render_nodes(addresses: Iterable[str]) -> str:
    """The nodes file: one canonical address a line, sorted (numerically), no duplicates."""
    unique = {ipaddress.ip_address(a) for a in addresses}
    ordered = sorted(unique, key=lambda a: (a.version, int(a)))
    return "".join(f"{a}\n" for a in ordered)


def parse_nodes(text: str) -> list[str]:
    """The addresses of a nodes file (blank and ``#`` lines skipped; a bad line is skipped too, as the
    daemon only logs it)."""
    out: list[str] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            out.append(str(ipaddress.ip_address(line)))
        except ValueError:
            continue
    return out


def clique_members(nodes: Mapping[str, str | None], own_name: str, own_ip: str) -> list[str]:
    """The peer list for this node: the InternalIPs of ``nodes`` (name → InternalIP or None; the Nodes that
    carry this node's clique label) plus this node's own address. A Node without an InternalIP is left out."""
    addresses = {own_ip}
    for name, ip in nodes.items():
        if name == own_name or not ip:
            continue
        try:
            addresses.add(str(ipaddress.ip_address(ip)))
        except ValueError:
            continue
    return sorted(addresses, key=lambda a: (ipaddress.ip_address(a).version, int(ipaddress.ip_address(a))))


@dataclass(frozen=True)
class MembershipChange:
    """What a new peer list asks of a running daemon."""

    added: tuple[str, ...]
    removed: tuple[str, ...]

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed)


def membership_change(old: Iterable[str], new: Iterable[str]) -> MembershipChange:
    before, after = set(old), set(new)
    return MembershipChange(added=tuple(sorted(after - before)), removed=tuple(sorted(before - after)))
