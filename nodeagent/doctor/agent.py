"""doctor's agent area: the node's config, ``nodeagent run`` running (its pid, unit or pod), its systemd unit,
the agent's record (reloads, clean stops), the last bootstrap."""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass

from nodeagent import fileio
from nodeagent.agentrecord import RECORD, AgentRecord, lock_holder, read_record
from nodeagent.doctor.findings import Report, Sources, when
from nodeagent.errors import NodeAgentError
from nodeagent.hostpaths import HostPaths

BOOTSTRAP_REPORT = "/run/nodeagent/bootstrap.json"
MAX_SMALL_FILE = 4 << 20
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
UNIT = "nodeagent.service"
UNIT_DIRS = ("/etc/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system")
UNIT_WANTS = "/etc/systemd/system/multi-user.target.wants"
RECENT_S = 3600.0  # an unclean end of the agent older than this is told as history, not as a warning


@dataclass(frozen=True)
class AgentView:
    """What doctor knows of ``nodeagent run`` on this root: its record (or why it cannot be read), and the
    agents running: the holder of the record's lock (``agentrecord.LOCK``) and those the root's /proc shows
    (None: neither can tell, a root without /proc and without the lock)."""

    record: AgentRecord | None
    record_error: str
    running: tuple[int, ...] | None

    @property
    def live(self) -> AgentRecord | None:
        """The record when its run is on: no clean stop in it and its pid running (taken as running when
        nothing can tell)."""
        r = self.record
        if r is None or r.stopped is not None or (self.running is not None and r.pid not in self.running):
            return None
        return r

    @property
    def record_pid(self) -> int:
        return self.record.pid if self.record is not None else 0

    def is_agent(self, pid: int) -> bool:
        """Whether a process (a socket's listener) is a running agent; False when nothing can tell."""
        return self.running is not None and pid in self.running


def look_at_agent(src: Sources) -> AgentView:
    try:
        record, error = read_record(src.paths), ""
    except NodeAgentError as e:
        record, error = None, str(e)
    lock = lock_holder(src.paths)
    running: set[int] | None = set(agent_pids(src.paths)) if src.paths.proc.is_dir() else None
    if lock.present:  # the lock tells the record's run from any root, a sandbox's without its pids in /proc
        running = running or set()
        if lock.holder:
            running.add(lock.holder)
        elif lock.holder == 0 and record is not None:  # held by a process of another pid namespace
            running.add(record.pid)
    return AgentView(record, error, None if running is None else tuple(sorted(running)))


def check_agent(src: Sources, view: AgentView, report: Report) -> None:
    record, record_error = view.record, view.record_error
    if src.config_problem:
        report.add("agent", "error", f"the agent's config cannot be used: {src.config_problem} (doctor checked "
                   "with the defaults; a running agent keeps the config it had, a starting one exits)",
                   "correct the file, then reload the agent")
    if record_error:
        report.add("agent", "warning", f"{record_error} (left by another version?)")
    installed, enabled = _unit_state(src.paths)
    _unit_activity(src, installed, report)
    running = view.running
    if running is None:  # a root without /proc (an image, the DaemonSet's /host) and no lock to ask
        if record is None:
            report.add("agent", "ok", f"not checked: no /proc under {src.paths.root} and no {RECORD}")
        elif record.stopped is not None:
            report.add("agent", "warning", f"the agent (pid {record.pid}) stopped at {when(record.stopped, src)}; "
                       f"whether one runs now is not checked (no /proc under {src.paths.root})")
        else:
            report.add("agent", "ok", f"the agent's record: pid {record.pid}, started {when(record.started, src)} "
                       f"with {record.config}; whether it still runs is not checked (no /proc under "
                       f"{src.paths.root})")
    elif running:
        where = {_where(src.paths, pid) for pid in running} - {""}
        since = (f", started {when(record.started, src)} with {record.config}"
                 if record is not None and record.pid in running else "")
        report.add("agent", "ok", f"nodeagent run is running (pid {', '.join(map(str, running))})"
                   + (f" in {', '.join(sorted(where))}" if where else "") + since)
        if installed and not enabled and not any(w.startswith("pod ") for w in where):
            report.add("agent", "warning", f"{UNIT} is not enabled: the agent will not start at the next boot",
                       _systemctl(src, "enable"))
    else:
        ended = ""
        if record is not None:
            ended = (f"; the last one (pid {record.pid}) stopped at {when(record.stopped, src)}"
                     if record.stopped is not None else
                     f"; the last one (pid {record.pid}, started {when(record.started, src)}) ended without a "
                     "clean stop (killed or crashed)")
        if src.simulated:
            fix = src.agent_command("run")
        elif installed:
            fix = _systemctl(src, "enable --now" if not enabled else "start")
        else:
            fix = ("systemctl start nodeagent (bare metal), the DaemonSet's pod (Kubernetes), or "
                   + src.agent_command("run"))
        unit = (f" ({UNIT} installed, {'enabled' if enabled else 'not enabled'})" if installed else "")
        report.add("agent", "warning", f"nodeagent run is not running on this host{unit}{ended}", fix)
    if record is not None:
        # the record's run is over when it says so, or when neither its lock nor /proc shows it
        _reload_finding(src, record, installed, view.live is not None, report)
        _unclean_finding(src, record, report)
    _bootstrap_finding(src, report)


def _unit_activity(src: Sources, installed: bool, report: Report) -> None:
    """systemd's own state of the agent's unit (active, failed, restarting), on the real host only."""
    if src.host is None:
        if installed:
            report.add("agent", "ok", f"{UNIT}: whether systemd has it active or failed is not checked under --root "
                       f"{src.paths.root} (nothing is executed there)")
        return
    state = src.host.unit_state(UNIT)
    if state.problem:
        if installed:  # (no unit file and no systemd to ask: nothing to tell)
            report.add("agent", "warning", f"{UNIT}: systemd's state not read: {state.problem}")
        return
    load, active, sub = state.get("LoadState"), state.get("ActiveState"), state.get("SubState")
    result, restarts = state.get("Result"), state.get("NRestarts") or "0"
    if load == "not-found":
        if installed:
            report.add("agent", "warning", f"{UNIT} is installed but systemd has not loaded it",
                       "systemctl daemon-reload")
        return
    what = f"{UNIT} {active} ({sub}), result {result}, {restarts} restart(s) since it was started"
    journal = "journalctl -u nodeagent -b"
    if active == "failed":
        report.add("agent", "error", f"{what}: systemd gave up on the agent",
                   f"read why: {journal}; correct it, then systemctl reset-failed nodeagent && systemctl start "
                   "nodeagent")
    elif sub == "auto-restart" or (active in ("activating", "deactivating") and result not in ("", "success")):
        report.add("agent", "error", f"{what}: the agent keeps failing and systemd restarts it",
                   f"read why: {journal}")
    elif active == "active":
        report.add("agent", "ok" if result in ("", "success") else "warning", what,
                   "" if result in ("", "success") else f"read why it failed before: {journal}")
    else:
        report.add("agent", "ok", what)


def _reload_finding(src: Sources, record: AgentRecord, installed: bool, running: bool,
                    report: Report) -> None:
    """The time and outcome of the agent's last SIGHUP reload (its record), with the fix of a refused one."""
    last = record.last_reload
    if last is None:
        report.add("agent", "ok", f"no config reload since the agent's start at {when(record.started, src)}")
        return
    what = f"last config reload {when(last.time, src)}: {last.outcome}" + (f" ({last.detail})" if last.detail else "")
    if last.outcome in ("applied", "unchanged") or not running:
        report.add("agent", "ok", what + ("" if running else " (a run that is over)"))
        return
    config = record.config if record.config != "defaults" else "/etc/nodeagent/config.toml"
    under_systemd = installed and not src.simulated and str(src.paths.root) == "/"
    fix = f"correct {config} (or a file it names), then reload: " + (
        "systemctl reload nodeagent" if under_systemd else f"kill -HUP {record.pid}")
    report.add("agent", "warning", what + "; the agent keeps running on its previous config", fix)


def _unclean_finding(src: Sources, record: AgentRecord, report: Report) -> None:
    """Earlier runs since boot that ended without a clean stop: recent ones are a warning (a restart loop,
    the watchdog, a crash), older ones history."""
    if record.unclean_ends <= 0:
        return
    last = record.last_unclean
    seen = last.get("seen")
    recent = isinstance(seen, int | float) and src.now() - seen < RECENT_S
    text = (f"{record.unclean_ends} of the agent's {record.starts} starts since boot followed a run that ended "
            "without a clean stop" + (f" (the latest: pid {last['pid']}, started {when(last['started'], src)}, "
                                      f"its end seen {when(seen, src)})" if "pid" in last and "started" in last
                                      and seen is not None else ""))
    where = "journalctl -u nodeagent -b" if not src.simulated else ""
    report.add("agent", "warning" if recent else "ok", text, (f"read why: {where}" if where and recent else ""))


def _bootstrap_finding(src: Sources, report: Report) -> None:
    try:
        data = fileio.read_regular(src.paths(BOOTSTRAP_REPORT), max_bytes=MAX_SMALL_FILE)
        last = json.loads(data) if data else None
    except (NodeAgentError, ValueError):
        last = None
    if isinstance(last, dict):
        code = last.get("exit_code")
        failed = [s.get("step") for s in last.get("steps") or [] if isinstance(s, dict) and s.get("result") == "failed"]
        report.add("agent", "ok" if code in (0, 3) else "warning", f"last bootstrap: exit {code}"
                   + (f", failed: {', '.join(map(str, failed))}" if failed else ""),
                   "" if code in (0, 3) else
                   f"{src.agent_command('bootstrap')} --output {src.shell_path(BOOTSTRAP_REPORT)}")


def _unit_state(paths: HostPaths) -> tuple[bool, bool]:
    """Whether the root has the agent's systemd unit installed, and enabled (wanted by multi-user.target);
    read from the unit files, as ``systemctl --root`` would (no D-Bus, nothing run)."""

    def exists(directory: str) -> bool:
        try:
            return os.path.lexists(paths(directory) / UNIT)
        except NodeAgentError:
            return False

    return any(exists(d) for d in UNIT_DIRS), exists(UNIT_WANTS)


def _systemctl(src: Sources, verb: str) -> str:
    """A systemctl command for the agent's unit on this root: ``--root`` for a root other than ``/`` (only
    enable/disable work there: nothing runs under a root)."""
    root = str(src.paths.root)
    if root == "/":
        return f"systemctl {verb} nodeagent"
    if verb.startswith("enable"):
        return f"systemctl --root {shlex.quote(root)} enable nodeagent"
    return f"systemctl {verb} nodeagent (on the host whose root is {root})"


def _where(paths: HostPaths, pid: int) -> str:
    """The systemd unit or the Kubernetes pod a process runs in (from its cgroup), "" when neither shows."""
    try:
        data = fileio.read_regular(paths.proc / str(pid) / "cgroup", max_bytes=1 << 16)
    except NodeAgentError:
        return ""
    for line in (data or b"").decode("utf-8", "replace").splitlines():
        parts = [p for p in line.rpartition(":")[2].split("/") if p]
        if any(p.startswith("kubepods") for p in parts):
            uids = [m.group(1).replace("_", "-") for p in parts if (m := _POD_UID.search(p))]
            if uids:
                return f"pod {uids[-1]}"
        units = [p for p in parts if p.endswith(".service")]
        if units:
            return "unit " + units[-1]
    return ""


def agent_pids(paths: HostPaths) -> Iterable[int]:
    """Processes under the root's /proc whose command line is ``... nodeagent ... run``."""
    proc = paths.proc
    try:
        entries = [p for p in proc.iterdir() if p.name.isdigit()]
    except OSError:
        return
    for entry in entries:
        try:
            data = fileio.read_regular(entry / "cmdline", max_bytes=1 << 16)
        except NodeAgentError:
            continue
        if not data:
            continue
        args = [a.decode("utf-8", "replace") for a in data.split(b"\0") if a]
        names = [posixpath.basename(a) for a in args[:3]]
        if ("nodeagent" in names or (len(args) > 2 and args[1:3] == ["-m", "nodeagent"])) and "run" in args:
            yield int(entry.name)
