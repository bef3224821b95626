"""What every command gets from the ``nodeagent`` group: its typed ``Settings`` (through ``settings_of``)
and the ``Group`` whose help lists whole first sentences. ``nodeagent/cli.py`` builds both; the commands
import them from here, never from the CLI module that loads them."""

from __future__ import annotations

import logging
import os
import re
import shlex
from pathlib import Path

import click

from nodeagent.hostpaths import HostPaths


class Group(click.Group):
    """A click group whose command list shows each command's whole first sentence (click cuts summaries
    at the terminal width, mid-word)."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows: list[tuple[str, str]] = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is None or cmd.hidden:
                continue
            rows.append((name, cmd.short_help or summary(cmd.help or "")))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def summary(text: str) -> str:
    """The first sentence of a help text (its first paragraph when that has no full stop)."""
    first = " ".join(text.strip().split("\n\n", 1)[0].split())
    m = re.match(r"(.+?[.!?])(?:\s|$)", first)
    return m.group(1) if m else first


class Settings:
    """Global options shared with every subcommand through ``ctx.obj`` (read it with ``settings_of``).

    ``paths`` is built from the absolute, symlink-resolved root (``HostPaths`` does that once), so a
    relative ``--root ./demo`` never reaches a socket address or a file name below it.

    A simulated machine never acts on the real host: a command that uses the simulator
    (``simulate(label)``, called by the ``--simulate``/``--sim-state`` options) gets, when no ``--root``
    was given, a sandbox root of its own (``default_sim_root``), made the first time the command asks for
    ``paths``; ``--root /`` with the simulator is refused.
    """

    def __init__(self, root: Path, log_format: str, log_level: str, *, root_given: bool = False,
                 root_on_host: str | None = None) -> None:
        if root_on_host is not None and not root_on_host.startswith("/"):
            raise click.BadParameter(f"must be an absolute path, not {root_on_host!r}", param_hint="--root-on-host")
        self.root_on_host = root_on_host
        self._paths = HostPaths(root, root_on_host)
        self.log_format = log_format
        self.log_level = log_level
        self.root_given = root_given
        self._simulator: str | None = None
        self.sandbox_default = False  # the root is the simulator's default sandbox, not one the user gave

    @property
    def paths(self) -> HostPaths:
        if self._simulator is not None and not self.root_given and not self.sandbox_default:
            root = default_sim_root(self._simulator)
            try:
                root.mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as e:
                raise click.UsageError(
                    f"cannot make the simulator's sandbox {root} ({e.strerror}); give one with --root DIR") from e
            self._paths = HostPaths(root, self.root_on_host)
            self.sandbox_default = True
            logging.getLogger("nodeagent").debug(
                "simulated machine: host paths are under %s (choose another with --root DIR)", root)
        return self._paths

    def set_root(self, root: Path) -> None:
        """``--root`` given (again) after the subcommand."""
        new = HostPaths(root, self.root_on_host)
        if self.root_given and self._paths.root != new.root:
            raise click.UsageError(
                f"--root given twice with different directories: {self._paths.root} and {new.root}")
        self._paths = new
        self.root_given = True
        self._check_simulated_root()

    def simulate(self, label: str) -> None:
        """The command runs on the NVML simulator (``label``: the state file's name, else the machine). A
        later, more precise label (the state file given after ``--simulate``) replaces the first one until
        the sandbox is made, so the sandbox never depends on which of the two flags came first."""
        if self._simulator is None or not self.sandbox_default:
            self._simulator = label
        self._check_simulated_root()

    def sim_state(self, given: Path | str | None, flag: str = "--sim-state") -> Path | None:
        """The simulator's state file for a command. Given under ``--root`` as a path into the root: a file of
        the (simulated) node, resolved there as a chroot would, its directory made; a path that climbs out of
        the root (``ROOT/../x``) is refused (``ConfigError`` naming ``flag``). Given outside the root without
        ``..``: the user's own file, used where it is (its directory made). Given without ``--root``: the path as the
        shell sees it. Not given, on the simulator's default sandbox: ``sim-state.json`` in that sandbox, so
        the machine's MIG layout and faults are there for the next command as on a real node. Otherwise
        None (a machine in memory, gone with the process)."""
        if given is None:
            if self._simulator is not None and not self.root_given:
                return self.paths.root / SANDBOX_STATE
            return None
        if not self.root_given:
            return Path(os.path.abspath(given))
        from nodeagent import fileio
        from nodeagent.config import flag_path
        from nodeagent.errors import InputError

        paths = self._paths
        plain = Path(os.path.abspath(given))
        if ".." not in Path(given).parts and plain != paths.root and paths.root not in plain.parents:
            # a file named outside the root, as the shell sees it: the simulator's own state (like --config or
            # --output, the user's file), used where it is; only a path that climbs out of the root is refused
            try:
                fileio.makedirs(plain.parent)
            except OSError as e:
                raise InputError(f"{flag} {given}: cannot make its directory: {e.strerror}", subject=flag) from e
            return plain
        host = flag_path(paths, Path(given), flag)
        assert host is not None
        resolved = paths(host)
        if host != "/" and resolved != paths.root:
            try:
                fileio.makedirs(resolved.parent, root=paths)
            except OSError as e:
                raise InputError(f"{flag} {given}: cannot make its directory: {e.strerror}", subject=flag) from e
        return resolved

    def simulated_by_config(self, machine: str, state: str) -> None:
        """A config file's ``[simulate]`` (not a flag) asks for the simulator: it needs a root given on the
        command line, since that config was itself read through the root."""
        label = simulation_label(machine or None, Path(state) if state else None)
        if state and self.root_given:
            self.sim_state(state, "simulate.state")  # the node's state: inside the root, as the flag
        if label is None or self._simulator is not None:
            return
        if not self.root_given:
            raise click.UsageError(
                "the config's [simulate] section asks for the simulator, which never acts on this host: "
                "give a sandbox with --root DIR")
        self.simulate(label)

    def _check_simulated_root(self) -> None:
        if self._simulator is not None and self.root_given and self._paths.root == Path("/"):
            raise click.UsageError(
                "--root / with the simulator would lay its fake GPU files and CDI spec on this host; "
                "give a sandbox directory (--root ./demo) or leave --root out for the default sandbox "
                f"{default_sim_root(self._simulator)}")

    def command_prefix(self) -> str:
        """``nodeagent`` with the global options in use, for hints that name a command to run next."""
        parts = ["nodeagent"]
        if self.root_given or self.sandbox_default:
            parts += ["--root", shlex.quote(str(self._paths.root))]
        if self.log_format != "text":
            parts += ["--log-format", self.log_format]
        return " ".join(parts)


SANDBOX_STATE = "sim-state.json"  # the state file of the simulator's default sandbox, in the sandbox


def default_sim_root(label: str) -> Path:
    """The simulator's sandbox when no ``--root`` is given: ``$XDG_RUNTIME_DIR/nodeagent-sim/<label>``
    (else under ``~/.local/state``), never the host's ``/``."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", label)[:60].lstrip(".") or "machine"
    base = os.environ.get("XDG_RUNTIME_DIR") or str(Path.home() / ".local" / "state")
    return Path(base) / "nodeagent-sim" / safe


def settings_of(ctx: click.Context) -> Settings:
    """The global settings of this invocation (defaults when a command runs without the group)."""
    found = ctx.find_object(Settings)
    if found is None:
        found = Settings(Path("/"), "text", "info")
        ctx.find_root().obj = found
    return found


def simulation_label(machine: str | None, state: Path | None) -> str | None:
    """What names a simulated machine's sandbox: the state file when one is given (the same file gives the
    same sandbox, whether ``--simulate`` is repeated or not), else the machine; None: no simulator."""
    if state is not None:
        return "state-" + state.stem
    if machine:
        return machine
    return None
