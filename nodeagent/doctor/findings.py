"""What doctor's areas share: a finding and the report of them, how doctor reaches the node (``Sources``),
what it may run on the real host (``HostChecks``), and how a time is told."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from nodeagent.config import AgentConfig
from nodeagent.gpu.inventory import Inventory
from nodeagent.hostpaths import HostPaths

if TYPE_CHECKING:
    from nodeagent.hostcommands import ConfigVerdict, UnitState

Level = Literal["ok", "warning", "error"]
AREAS = ("driver", "gpus", "health", "containerd", "cdi", "kubelet", "node", "agent")


@dataclass(frozen=True)
class Finding:
    area: str
    level: Level
    text: str
    fix: str = ""  # the command that fixes it (global options included), "" when there is none


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)

    def add(self, area: str, level: Level, text: str, fix: str = "") -> None:
        self.findings.append(Finding(area, level, " ".join(text.split()), fix))

    @property
    def exit_code(self) -> int:
        levels = {f.level for f in self.findings}
        return 2 if "error" in levels else 1 if "warning" in levels else 0

    def to_json(self) -> str:
        return json.dumps({"exit_code": self.exit_code, "findings": [asdict(f) for f in self.findings]}, indent=2)

    def render(self) -> str:
        lines = []
        for f in self.findings:
            lines.append(f"{f.level:<8}{f.area:<11}{f.text}")
            if f.fix:
                lines.append(f"{'':19}fix: {f.fix}")
        return "\n".join(lines)


@dataclass(frozen=True)
class HostChecks:
    """What doctor may run on the real host (root ``/``), through ``nodeagent.hostcommands``; ``Sources.host``
    is None under ``--root``, where nothing is executed."""

    unit_state: Callable[[str], UnitState]  # a unit name -> systemd's ActiveState, SubState, Result, NRestarts
    containerd_loads: Callable[[str], ConfigVerdict] | None = None  # a config file -> containerd's verdict
    containerd: str = ""  # the containerd program asked ("" when none was found)


@dataclass(frozen=True)
class Sources:
    """How doctor reaches the node: each a callable, so tests and the CLI hand in the same adapters."""

    paths: HostPaths
    config: AgentConfig
    discover: Callable[[], Inventory]  # raises NodeAgentError when NVML cannot be used
    command: Callable[[str], str]  # a subcommand -> the whole command line with the options in use
    kube: Callable[[], Any] | None = None  # a KubeClient, or None with --no-kube
    node_name: str = ""
    recovery: Callable[[list[int]], dict[int, int]] | None = None  # GPU indices -> the driver's recovery actions
    simulated: bool = False
    sim_fix: str = ""  # the options that reach the same simulated machine ("--simulate X --sim-state F")
    now: Callable[[], float] = time.time
    config_problem: str = ""  # why the node's config file cannot be used (checked with the defaults then)
    host: HostChecks | None = None  # None under --root: nothing is executed there
    # the options in use that ``run``, ``bootstrap`` and ``doctor`` take alike ("--config F --no-kube
    # --kubeconfig K --node-name N", those given), and the kubeconfig alone (for ``adopt``)
    agent_opts: str = ""
    kubeconfig_opt: str = ""

    def gpu_command(self, subcommand: str) -> str:
        """``command`` for a subcommand that opens the GPUs: on the same simulated machine, if any."""
        return self.command(f"{subcommand} {self.sim_fix}".strip())

    def agent_command(self, subcommand: str, *, sim: bool = True) -> str:
        """``command`` for ``run``, ``bootstrap`` or ``doctor``: the simulated machine (unless ``sim`` is
        False), the config, --no-kube and the API options as this doctor was given them, so that it runs as
        printed (``run`` without --no-kube would want credentials this doctor did without)."""
        words = [subcommand, self.sim_fix if sim else "", self.agent_opts]
        return self.command(" ".join(w for w in words if w))

    def adopt_command(self, extra: str = "") -> str:
        """``adopt`` for this node, through the kubeconfig doctor was given (adopt works only through the API)."""
        words = ["adopt", "--node-name", shlex.quote(self.node_name), self.kubeconfig_opt, extra]
        return self.command(" ".join(w for w in words if w))

    def shell_path(self, host_path: str) -> str:
        """A host path as the user's shell names it: under the root (a path flag's form)."""
        return shlex.quote(str(self.paths.root / host_path.lstrip("/")))



def when(t: float | None, src: Sources) -> str:
    """A time as UTC with its age: ``2026-11-26T18:02:11Z (3 min ago)``."""
    if t is None:
        return "an unknown time"
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
    age = max(0.0, src.now() - t)
    ago = (f"{age:.0f} s" if age < 120 else f"{age / 60:.0f} min" if age < 7200 else f"{age / 3600:.1f} h"
           if age < 172800 else f"{age / 86400:.0f} days")
    return f"{stamp} ({ago} ago)"

