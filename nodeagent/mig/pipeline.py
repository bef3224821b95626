"""The one MIG pipeline every entry point uses: ``nodeagent mig``, ``bootstrap --mig-config`` and the daemon.

    load (config + hooks files, one error policy) → select → resolve → plan → recover → apply

Loading: a file that is named but missing or unreadable is a ``ConfigError`` (exit 2) naming the file and
how it was named (``-f``, ``--hooks-file``, ``mig.config_file``, ``mig.hooks_file``), wherever it is
read. Only the default ``mig.config_file`` may be absent: the standard configs are then generated for the
node's GPUs. Everything is read and checked before any GPU is touched, so bad input changes nothing.

Recovery: an apply that was interrupted (a killed agent or command) left checkpoints in the MIG state
file; ``recover`` puts every GPU it left half-changed back before the real plan is made.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nodeagent.config import MigSettings, read_named_file, require_named_file
from nodeagent.errors import ConfigError
from nodeagent.fileio import MAX_READ_BYTES, read_stream
from nodeagent.gpu.inventory import Inventory
from nodeagent.gpu.ports import MigAdministration
from nodeagent.hostpaths import HostPaths
from nodeagent.mig.apply import Applier, ApplyResult, MigStateFile, Recovery, recover_interrupted
from nodeagent.mig.hooks import HookRunner, Hooks, parse_hooks
from nodeagent.mig.planner import Plan, plan
from nodeagent.mig.spec import MigConfigFile, generate_standard, parse_config, resolve

STDIN = "-"


@dataclass(frozen=True)
class MigSources:
    """The parsed MIG config and hooks files, and how they were named (for the hooks' environment)."""

    configs: MigConfigFile | None = None  # None = the standard configs for the node's GPUs
    hooks: Hooks | None = None  # None = no hooks
    config_file: str = ""  # MIG_PARTED_CONFIG_FILE for the hooks
    hooks_file: str = ""  # MIG_PARTED_HOOKS_FILE for the hooks
    digest: str = ""  # fingerprint of the files' text: a reload notices an edit of them alone

    def configs_for(self, inventory: Inventory) -> MigConfigFile:
        return self.configs if self.configs is not None else generate_standard(inventory)


def load_sources(
    config_path: Path | str | None,
    hooks_path: Path | None = None,
    *,
    config_key: str = "-f",
    hooks_key: str = "--hooks-file",
    config_optional: bool = False,
    config_shown: str | None = None,
    hooks_shown: str | None = None,
) -> MigSources:
    """Read and parse the MIG config file (``-`` = stdin; None = generated standard configs) and the hooks
    file. ``config_optional``: a missing config file means the standard configs (the default
    ``mig.config_file``). The hooks see the paths that were read (under ``--root``), "" for generated
    configs."""
    configs: MigConfigFile | None = None
    text = ""
    if config_path == STDIN:
        text = _read_stdin()
        configs = parse_config(text, "<stdin>")
    elif config_path is not None:
        path = Path(config_path)
        where = config_shown or str(path)
        read = read_named_file(path, "MIG config file", config_key, where)
        if read is None and not config_optional:
            raise ConfigError(f"{where}: MIG config file ({config_key}) not found", subject=where)
        if read is not None:
            text = read
            configs = parse_config(read, where)
    hooks: Hooks | None = None
    hooks_text = ""
    if hooks_path is not None:
        hooks_where = hooks_shown or str(hooks_path)
        hooks_text = require_named_file(hooks_path, "MIG hooks file", hooks_key, hooks_where)
        hooks = parse_hooks(hooks_text, hooks_where)
    digest = hashlib.sha256(f"{text}\0{hooks_text}".encode()).hexdigest()
    return MigSources(
        configs,
        hooks,
        config_file=str(config_path) if configs is not None else "",
        hooks_file=str(hooks_path or ""),
        digest=digest,
    )


def _read_stdin() -> str:
    """Standard input, bounded like a file (`yes | nodeagent mig plan -f -` never ends)."""
    binary = getattr(sys.stdin, "buffer", None)
    if binary is None:  # a text stream without bytes below (an embedding caller's)
        text = sys.stdin.read(MAX_READ_BYTES + 1)
        if len(text) > MAX_READ_BYTES:
            raise ConfigError(f"<stdin>: more than the {MAX_READ_BYTES} bytes nodeagent reads", subject="<stdin>")
        return text
    raw = read_stream(binary, "<stdin>")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"<stdin>: not UTF-8 text ({e.reason} at byte {e.start})", subject="<stdin>") from e


def load_configured_sources(settings: MigSettings, paths: HostPaths) -> MigSources:
    """The files ``[mig] config_file`` and ``hooks_file`` name (under ``--root``), as the daemon and
    ``bootstrap`` read them: only the default config file may be missing (then the standard configs)."""
    return load_sources(
        paths(settings.config_file),
        paths(settings.hooks_file) if settings.hooks_file else None,
        config_key="mig.config_file",
        hooks_key="mig.hooks_file",
        config_optional=settings.config_file == MigSettings().config_file,
        config_shown=paths.shown(settings.config_file),
        hooks_shown=paths.shown(settings.hooks_file) if settings.hooks_file else None,
    )


def plan_config(sources: MigSources, name: str | None, inventory: Inventory) -> Plan:
    """select → resolve → plan; every bad input (unknown name, missing GPU index, impossible layout) is a
    ``ConfigError`` here, before anything is touched."""
    configs = sources.configs_for(inventory)
    selected, entries = configs.select(name)
    return plan(inventory, resolve(selected, entries, inventory, configs.source))


def unselected_mig_gpus(the_plan: Plan, inventory: Inventory) -> tuple[int, ...]:
    """MIG-capable GPUs the config does not select (``mig assert`` fails on them, as mig-parted's does)."""
    skipped = set(the_plan.skipped)
    return tuple(g.index for g in inventory.gpus if g.index in skipped and g.mig_capable)


@dataclass(frozen=True)
class Prepared:
    """A plan made against the GPUs as they are after any recovery."""

    inventory: Inventory
    plan: Plan
    recovery: Recovery | None = None


class MigPipeline:
    """The steps after loading, on one adapter. ``prepare`` runs them in order for the one-shot commands;
    the daemon's reconciler calls them one by one (it withdraws device-plugin resources in between)."""

    def __init__(
        self,
        adapter: MigAdministration,
        sources: MigSources,
        *,
        state: MigStateFile | None = None,
        proc_root: Path = Path("/proc"),
        pod_name: Callable[[str], str | None] | None = None,
    ) -> None:
        self.adapter = adapter
        self.sources = sources
        self.state = state
        self.proc_root = proc_root
        self.pod_name = pod_name

    def plan(self, name: str | None, inventory: Inventory | None = None) -> tuple[Inventory, Plan]:
        inv = inventory if inventory is not None else self.adapter.discover()
        return inv, plan_config(self.sources, name, inv)

    def recover(self) -> Recovery | None:
        """Put back the GPUs an interrupted apply left half-changed (None: no apply was interrupted)."""
        if self.state is None:
            return None
        return recover_interrupted(self.adapter, self.state)

    def prepare(self, name: str | None, *, recover: bool = True) -> Prepared:
        """Plan (bad input stops here, nothing changed), recover an interrupted apply, plan again if the
        recovery changed the GPUs."""
        inv, the_plan = self.plan(name)
        recovery = self.recover() if recover else None
        if recovery is not None:
            inv, the_plan = self.plan(name)
        return Prepared(inv, the_plan, recovery)

    def hook_runner(self, the_plan: Plan) -> HookRunner | None:
        if self.sources.hooks is None:
            return None
        env = HookRunner.environment(config_file=self.sources.config_file, hooks_file=self.sources.hooks_file,
                                     selected=the_plan.config, gpus=sorted(g.index for g in the_plan.touched))
        return HookRunner(self.sources.hooks, env)

    def apply(self, the_plan: Plan, inventory: Inventory) -> ApplyResult:
        applier = Applier(self.adapter, hooks=self.hook_runner(the_plan), state=self.state,
                          proc_root=self.proc_root, pod_name=self.pod_name)
        return applier.apply(the_plan, inventory)
