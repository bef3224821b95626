"""mig-parted hooks files: parse (pure) and run the hooks around an apply.

File shape, as mig-parted reads it::

    version: v1
    hooks:
      apply-start:      [{workdir: DIR, command: PROG, args: [...], envs: {K: V}}, ...]
      pre-apply-mode:   [...]   # before a MIG mode change
      pre-apply-config: [...]   # before instances are destroyed/created
      apply-exit:       [...]   # always, at the end (also after a failure)

Each hook runs with the agent's environment plus ``MIG_PARTED_CONFIG_FILE``, ``MIG_PARTED_HOOKS_FILE``,
``MIG_PARTED_SELECTED_CONFIG``, ``MIG_PARTED_SKIP_RESET`` (as mig-parted sets them), ``NODEAGENT_MIG_GPUS``
(comma-separated indices of the GPUs that change) and the hook's own ``envs``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nodeagent.boundedyaml import load_document, plain, shown
from nodeagent.errors import ConfigError, OperationError
from nodeagent.hostcommands import run_bounded
from nodeagent.logs import one_line

log = logging.getLogger(__name__)

HOOK_NAMES = ("apply-start", "pre-apply-mode", "pre-apply-config", "apply-exit")
_HOOK_KEYS = frozenset({"workdir", "command", "args", "envs"})
DEFAULT_TIMEOUT_S = 300.0
MAX_ARG_STRLEN = 131072  # Linux: the most one argument or environment entry may hold, its NUL included
KEPT_OUTPUT = 64 * 1024  # bytes of a hook's stdout and of its stderr kept for the error line (the tail)
MAX_SHOWN_COMMAND = 200  # characters of a hook's command line in a message
MAX_SHOWN_OUTPUT = 300  # characters of a hook's last output line (or of the error of starting it)


@dataclass(frozen=True)
class Hook:
    command: str
    args: tuple[str, ...] = ()
    workdir: str | None = None
    envs: tuple[tuple[str, str], ...] = ()

    def argv(self) -> list[str]:
        return [self.command, *self.args]


@dataclass(frozen=True)
class Hooks:
    by_name: Mapping[str, tuple[Hook, ...]] = field(default_factory=dict)
    source: str = ""

    def get(self, name: str) -> tuple[Hook, ...]:
        return tuple(self.by_name.get(name, ()))


def parse_hooks(text: str, source: str = "<hooks>") -> Hooks:
    doc = load_document(text, source)  # no aliases, bounded depth and size
    return load_hooks(doc, source)


def load_hooks(doc: Any, source: str = "<hooks>") -> Hooks:
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: expected a mapping with 'version' and 'hooks'", subject=source)
    for key in doc:
        if key not in ("version", "hooks"):
            raise ConfigError(f"{source}: unknown top-level key {shown(key)}", subject=source)
    if doc.get("version") != "v1":
        raise ConfigError(f"{source}: 'version' must be v1, not {shown(doc.get('version'))}", subject=source)
    raw = doc.get("hooks") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: 'hooks' must be a mapping of hook name → list", subject=source)
    out: dict[str, tuple[Hook, ...]] = {}
    for name, items in raw.items():
        if name not in HOOK_NAMES:
            raise ConfigError(f"{source}: unknown hook {shown(name)} (known: {', '.join(HOOK_NAMES)})",
                              subject=source)
        if items is None:
            items = []
        if not isinstance(items, list):
            raise ConfigError(f"{source}: hook {name} must be a list", subject=source)
        out[name] = tuple(_hook(item, f"{source}: hook {name}[{i}]") for i, item in enumerate(items))
    return Hooks(out, source)


def _hook(raw: Any, here: str) -> Hook:
    if not isinstance(raw, dict):
        raise ConfigError(f"{here}: must be a mapping with 'command'", subject=here)
    for key in raw:
        if key not in _HOOK_KEYS:
            raise ConfigError(f"{here}: unknown key {shown(key)}", subject=here)
    command = raw.get("command")
    if not isinstance(command, str) or not command:
        raise ConfigError(f"{here}: 'command' must be a non-empty string", subject=here)
    _exec_string(command, here, "'command'")
    args = raw.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConfigError(f"{here}: 'args' must be a list of strings", subject=here)
    for i, arg in enumerate(args):
        _exec_string(arg, here, f"args[{i}]")
    workdir = raw.get("workdir")
    if workdir is not None and not isinstance(workdir, str):
        raise ConfigError(f"{here}: 'workdir' must be a string", subject=here)
    if workdir:
        _exec_string(workdir, here, "'workdir'")
    envs = raw.get("envs") or {}
    if not isinstance(envs, dict) or not all(isinstance(k, str) for k in envs):
        raise ConfigError(f"{here}: 'envs' must be a mapping of names to values", subject=here)
    pairs: list[tuple[str, str]] = []
    for name, value in envs.items():
        if not name or "=" in name:
            raise ConfigError(f"{here}: envs: {shown(name)} is not a variable name (empty, or with '=')",
                              subject=here)
        if isinstance(value, dict | list):
            raise ConfigError(f"{here}: envs.{plain(name)} must be a string, got {shown(value)}", subject=here)
        pairs.append((name, str(value)))
        _exec_string(f"{name}={value}", here, f"envs.{plain(name)}")
    return Hook(command, tuple(args), workdir or None, tuple(pairs))


def _exec_string(value: str, here: str, what: str) -> None:
    """Refuse a string no program can be given: a NUL byte, text that is not UTF-8, or longer than the
    kernel passes as one argument or environment entry (``MAX_ARG_STRLEN``)."""
    if "\x00" in value:
        raise ConfigError(f"{here}: {what} holds a NUL byte: {shown(value)}", subject=here)
    try:
        size = len(os.fsencode(value))
    except UnicodeEncodeError as e:
        raise ConfigError(f"{here}: {what} is not valid UTF-8 text ({e.reason}): {shown(value)}", subject=here) \
            from e
    if size >= MAX_ARG_STRLEN:
        raise ConfigError(f"{here}: {what} is {size} bytes, more than the {MAX_ARG_STRLEN - 1} Linux passes to a "
                          f"program in one argument or variable: {shown(value)}", subject=here)


class HookRunner:
    """Runs hooks by name with the mig-parted environment; a failing hook raises ``OperationError``."""

    def __init__(self, hooks: Hooks | None, env: Mapping[str, str],
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.hooks = hooks or Hooks()
        self.env = dict(env)
        self.timeout_s = timeout_s
        self.ran: list[str] = []

    @staticmethod
    def environment(*, config_file: str, hooks_file: str, selected: str, gpus: list[int],
                    skip_reset: bool = False) -> dict[str, str]:
        return {
            "MIG_PARTED_CONFIG_FILE": config_file,
            "MIG_PARTED_HOOKS_FILE": hooks_file,
            "MIG_PARTED_SELECTED_CONFIG": selected,
            "MIG_PARTED_SKIP_RESET": "true" if skip_reset else "false",
            "NODEAGENT_MIG_GPUS": ",".join(str(i) for i in gpus),
        }

    def run(self, name: str) -> None:
        for i, hook in enumerate(self.hooks.get(name)):
            env = {**os.environ, **self.env, **dict(hook.envs)}
            what = f"hook {name}[{i}] ({_quote(' '.join(hook.argv()), MAX_SHOWN_COMMAND)})"
            log.info("running %s", what)
            self.ran.append(name)
            # the output is drained as it comes and only its tail kept: a hook printing hundreds of megabytes
            # costs the agent no memory
            ran = run_bounded(hook.argv(), timeout=self.timeout_s, max_output=KEPT_OUTPUT, env=env,
                              cwd=hook.workdir, keep_tail=True)
            if ran.problem:
                raise OperationError(f"{what} could not run: {_quote(ran.problem, MAX_SHOWN_OUTPUT)}", subject=name)
            if ran.returncode != 0:
                text = (ran.stderr or ran.stdout).strip()
                tail = _quote(text.splitlines()[-1], MAX_SHOWN_OUTPUT) if text else ""
                raise OperationError(f"{what} exited {ran.returncode}: {tail}".rstrip(": "), subject=name)


def _quote(text: str, limit: int) -> str:
    """``text`` as one line of about ``limit`` characters at most, control characters escaped."""
    escaped = one_line(text[:limit], limit)
    more = len(text) - limit
    return escaped[:limit] + (f"... ({more} more characters)" if more > 0 else "..." if len(escaped) > limit else "")
