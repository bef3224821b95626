"""``nodeagent doctor`` on the agent itself, each finding on a simulated node that has it: the real ``nodeagent
run`` running in its systemd unit (installed, then enabled), its last config reload refused and then applied,
its clean stop; earlier runs that ended without a clean stop (recent: a warning; old: history); a root
without /proc (the DaemonSet's /host), where the record is all there is; the node's config file broken."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

from nodeagent.agentrecord import RECORD, AgentRecorder, read_record
from nodeagent.hostpaths import HostPaths
from tests.e2e._agent import REPO, ROOT, eventually, node_root, running_agent
from tests.e2e.test_doctor import _doctor, _na, _one

SIM = ["--simulate", "t4x1"]


def _agent_findings(root: Path) -> list[dict[str, str]]:
    return [f for f in _doctor(root, *SIM)[1] if f["area"] == "agent"]


def test_the_running_agent_in_its_unit_its_reloads_and_its_stop(tmp_path: Path) -> None:
    with node_root() as root, running_agent(tmp_path, root, ["run", *SIM, "--no-kube"]) as agent:
        # started (READY waits for a kubelet, which this node has none of)
        eventually(lambda: "component runtime started" in agent.log(), 30, "the agent's components started")
        record = eventually(lambda: read_record(HostPaths(root)), 10, "the agent's record")
        assert record.pid == agent.pid and record.config == "defaults" and record.stopped is None
        # what doctor sees of the process: its /proc entry under the root, in the unit's cgroup
        proc = root / "proc" / str(agent.pid)
        proc.mkdir(parents=True)
        (proc / "cmdline").write_bytes(Path(f"/proc/{agent.pid}/cmdline").read_bytes())
        (proc / "cgroup").write_text("0::/system.slice/nodeagent.service\n")
        (root / "lib/systemd/system").mkdir(parents=True)
        (root / "lib/systemd/system/nodeagent.service").write_text((REPO / "systemd/nodeagent.service").read_text())
        agent_findings = _agent_findings(root)
        _one(agent_findings, "agent", "ok", f"nodeagent run is running (pid {agent.pid}) in unit nodeagent.service, "
             "started 20")
        disabled = _one(agent_findings, "agent", "warning", "nodeagent.service is not enabled: the agent will not "
                        "start at the next boot")
        assert disabled["fix"] == f"systemctl --root {root} enable nodeagent"
        _one(agent_findings, "agent", "ok", "no config reload since the agent's start at 20")

        config = root / "etc/nodeagent/config.toml"
        config.parent.mkdir(parents=True)
        config.write_text("bogus_key = 1\n")
        agent.send(signal.SIGHUP)
        eventually(lambda: (r := read_record(HostPaths(root))) and r.reloads == 1, 10, "the refused reload recorded")
        code, findings = _doctor(root, *SIM)
        assert code == 2  # the config file doctor reads is broken too
        broken = _one(findings, "agent", "error", f"the agent's config cannot be used: {config}: unknown key "
                      "'bogus_key'")
        assert broken["fix"] == "correct the file, then reload the agent"
        refused = _one(findings, "agent", "warning", f"rejected ({config}: unknown key 'bogus_key'); the agent "
                       "keeps running on its previous config")
        assert refused["fix"] == f"correct /etc/nodeagent/config.toml (or a file it names), then reload: kill -HUP {agent.pid}"

        config.write_text('log_level = "debug"\n')
        agent.send(signal.SIGHUP)
        eventually(lambda: (r := read_record(HostPaths(root))) and r.reloads == 2, 10, "the applied reload recorded")
        # the fix printed for the unit not enabled, run as printed (systemctl works on a root offline)
        enabled = subprocess.run(shlex.split(disabled["fix"]), capture_output=True, text=True, timeout=60, check=False)
        assert enabled.returncode == 0, enabled.stderr
        assert (root / "etc/systemd/system/multi-user.target.wants/nodeagent.service").is_symlink()
        agent_findings = _agent_findings(root)
        assert [f["level"] for f in agent_findings] == ["ok", "ok", "ok"], agent_findings
        _one(agent_findings, "agent", "ok", "nodeagent.service: whether systemd has it active or failed is not "
             f"checked under --root {root} (nothing is executed there)")
        assert _one(agent_findings, "agent", "ok", "started 20")["text"].endswith(f"with {config}")
        _one(agent_findings, "agent", "ok", "applied (changed log_level)")

        assert agent.stop()[0] == 0
        record = read_record(HostPaths(root))
        assert record is not None and record.stopped is not None
        (proc / "cmdline").unlink()
        (proc / "cgroup").unlink()
        proc.rmdir()
        agent_findings = _agent_findings(root)
        gone = _one(agent_findings, "agent", "warning", "nodeagent run is not running on this host "
                    f"(nodeagent.service installed, enabled); the last one (pid {agent.pid}) stopped at 20")
        assert gone["fix"] == f"nodeagent --root {root} run --simulate t4x1 --no-kube"
        _one(agent_findings, "agent", "ok", "applied (changed log_level) (a run that is over)")


def test_unclean_ends_and_a_root_without_proc(tmp_path: Path) -> None:
    root = tmp_path / "node"
    root.mkdir()
    paths = HostPaths(root)
    hours_ago = time.time() - 7200
    AgentRecorder(paths, pid=4242, clock=lambda: hours_ago).started("")
    AgentRecorder(paths, pid=4343, clock=lambda: hours_ago + 5).started("")  # 4242 never stopped cleanly
    agent_findings = _agent_findings(root)
    _one(agent_findings, "agent", "ok", "the agent's record: pid 4343, started 20")
    _one(agent_findings, "agent", "ok", "whether it still runs is not checked (no /proc under")
    old = _one(agent_findings, "agent", "ok", "1 of the agent's 2 starts since boot followed a run that ended "
               "without a clean stop (the latest: pid 4242")
    assert "(2.0 h ago)" in old["text"]

    AgentRecorder(paths, pid=4444).started("")  # 4343 killed a moment ago: a restart loop, perhaps
    recent = _one(_agent_findings(root), "agent", "warning", "2 of the agent's 3 starts since boot followed a run "
                  "that ended without a clean stop (the latest: pid 4343")
    assert recent["fix"] == ""  # on the simulator there is no journal to read

    (root / RECORD.lstrip("/")).write_text('{"version": 7}')
    unreadable = _one(_agent_findings(root), "agent", "warning", f"{RECORD} is no agent record: not an agent "
                      "record of format 1 (left by another version?)")
    assert unreadable["fix"] == ""


def test_a_broken_config_given_on_the_command_line_is_a_bad_input(tmp_path: Path) -> None:
    root = tmp_path / "node"
    bad = tmp_path / "bad.toml"
    bad.write_text("[nope]\n")
    r = _na(root, "doctor", *SIM, "--no-kube", "--config", str(bad))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"error: {bad}: "), r.stderr
    assert not os.path.exists(root / RECORD.lstrip("/"))


def test_an_xid_the_running_agent_holds(tmp_path: Path) -> None:
    """An XID is an event: only the running agent saw it, and its record is how doctor learns of it (a GPU
    served Unhealthy to the kubelet), also without the API."""
    run = ["run", *SIM, "--sim-state", f"{ROOT}/t4.json", "--no-kube"]  # the state inside the node's root
    with node_root() as root, running_agent(tmp_path, root, run) as agent:
        state = root / "t4.json"
        sim = [*SIM, "--sim-state", str(state)]
        eventually(lambda: "component runtime started" in agent.log(), 30, "the agent's components started")
        proc = root / "proc" / str(agent.pid)
        proc.mkdir(parents=True)
        (proc / "cmdline").write_bytes(Path(f"/proc/{agent.pid}/cmdline").read_bytes())
        findings = _doctor(root, *sim)[1]
        _one(findings, "health", "ok", "the agent serves every GPU as Healthy (no XID held)")
        assert _na(root, "sim", "inject", "xid", "--sim-state", str(state), "--gpu", "0", "--code", "48").returncode == 0
        eventually(lambda: (r := read_record(HostPaths(root))) and r.unhealthy, 15, "the XID in the agent's record")
        code, findings = _doctor(root, *sim)
        assert code == 2
        held = _one(findings, "health", "error", "GPU 0 is served Unhealthy to the kubelet after XID 48 (the "
                    "agent's health monitor, since 20")
        assert held["fix"] == ""
        assert not [f for f in findings if "serves every GPU as Healthy" in f["text"]], findings
        assert agent.stop()[0] == 0
        # the run is over: what it held is not told as the node's state
        (proc / "cmdline").unlink()
        proc.rmdir()
        assert not [f for f in _doctor(root, *sim)[1] if "served Unhealthy" in f["text"]]
