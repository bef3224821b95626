"""The files ``nodeagent run`` reads besides config.toml — the device-plugin config, the MIG config — are input
like the config itself: a broken one stops the start with exit 2 and nothing served, and a broken edit is
refused on SIGHUP while the agent keeps the config it runs with; a good edit applies live."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.e2e._agent import Agent, node_root, running_agent
from tests.e2e.test_run import demo_args, plugin_sockets
from tests.e2e.test_run_cluster import agent_config, eventually, make_node, node_obj, set_label
from tests.peers.apiserver import KubeApiServer
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers

REPLICAS = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: {n}\n"
MPS = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/mig-1g.10gb\n      replicas: 2\n"

BAD_PLUGIN_CONFIGS = {
    "bad-yaml": ("version: v1\nsharing: [\n", "not valid YAML"),
    "mps": (MPS, "sharing.mps"),
    "unknown-key": ("version: v1\nflagz:\n  migStrategy: single\n", "flagz"),
    "missing": (None, "not found"),
}


def reload_and_wait(agent: Agent) -> None:
    """SIGHUP; returns once the agent answered (READY=1 again after RELOADING=1)."""
    seen = len(agent.poll_notify())
    agent.send(signal.SIGHUP)
    agent.wait_notify("RELOADING=1", after=seen)
    agent.wait_notify("READY=1", after=seen)


@pytest.mark.parametrize("case", sorted(BAD_PLUGIN_CONFIGS))
def test_invalid_device_plugin_config_exits_2_and_serves_nothing(tmp_path: Path, case: str) -> None:
    text, expected = BAD_PLUGIN_CONFIGS[case]
    with node_root() as root:
        dp = root / "etc/nodeagent/dp.yaml"
        dp.parent.mkdir(parents=True)
        if text is not None:
            dp.write_text(text)
        args = demo_args(root, "--device-plugin-config", str(dp))
        with running_agent(tmp_path, root, args) as agent:
            assert agent.proc.wait(15) == 2, agent.log()
            lines = agent.log().splitlines()
            assert len(lines) == 1, lines  # one line, no traceback, no "starting"
            assert lines[0].startswith(f"error: {dp}") and expected in lines[0], lines[0]
            assert not any(m.startswith("READY=1") for m in agent.poll_notify())
        plugin_dir = root / "var/lib/kubelet/device-plugins"
        assert not plugin_dir.exists() or not list(plugin_dir.glob("*.sock"))


def test_sighup_refuses_a_broken_device_plugin_config_and_applies_a_good_one(
    tmp_path: Path, kubelet_harness: KubeletHarness
) -> None:
    """Only the device-plugin config file is edited (config.toml stays the same): SIGHUP still notices."""
    config = tmp_path / "config.toml"
    config.write_text('[device_plugin]\nconfig = "/etc/nodeagent/dp.yaml"\n')
    with node_root(kubelet_harness) as root:
        dp = root / "etc/nodeagent/dp.yaml"  # a host path in the config, resolved under --root
        dp.parent.mkdir(parents=True)
        dp.write_text(REPLICAS.format(n=4))
        with running_agent(tmp_path, root, demo_args(root, "--config", str(config))) as agent:
            agent.wait_notify("READY=1")
            kubelet_harness.wait("nvidia.com/gpu", registered=True, total=32)
            huge = REPLICAS.format(n="9" * 5000)  # past Python's 4300-digit limit of int(str)
            for broken, expected in (("version: v1\nsharing: [\n", "not valid YAML"), (MPS, "sharing.mps"),
                                     (huge, "an integer of 5000 characters")):
                dp.write_text(broken)
                reload_and_wait(agent)
                rejected = [ln for ln in agent.log().splitlines() if "reload rejected" in ln]
                assert rejected and str(dp) in rejected[-1] and expected in rejected[-1], agent.log()
                assert len(rejected[-1]) < 1000 and "Traceback" not in agent.log(), rejected[-1][:2000]
                # still the running config: 32 replicas served and registered, the same socket
                res = kubelet_harness.resource("nvidia.com/gpu")
                assert res.registered and res.capacity == 32
                assert plugin_sockets(kubelet_harness) == {"nvidia-gpu.sock"}
            dp.unlink()
            reload_and_wait(agent)
            assert "device-plugin config (device_plugin.config) not found" in agent.log()
            assert kubelet_harness.resource("nvidia.com/gpu").capacity == 32
            # a good edit of the file alone applies live, in the same process
            dp.write_text(REPLICAS.format(n=2))
            reload_and_wait(agent)
            _, res = kubelet_harness.wait("nvidia.com/gpu", registered=True, total=16, timeout=15)
            assert all("::" in d.id for d in res.devices)
            assert "reload: changed device_plugin" in agent.log()
            code, took = agent.stop()
            assert code == 0 and took < 5.0


MIG_CONFIGS = """version: v1
mig-configs:
  small:
  - devices: all
    mig-enabled: true
    mig-devices:
      1g.10gb: 7
  whole:
  - devices: all
    mig-enabled: true
    mig-devices:
      7g.80gb: 1
"""


def test_invalid_mig_config_file_exits_2(tmp_path: Path, kube_apiserver: KubeApiServer) -> None:
    with node_root() as root:
        cfg = agent_config(root, kube_apiserver.kubeconfig, '[mig]\nconfig_file = "/etc/nodeagent/mig.yaml"\n')
        mig = root / "etc/nodeagent/mig.yaml"
        for text, expected in (("version: v1\nmig-configs: [\n", "not valid YAML"), (None, "not found")):
            if text is not None:
                mig.write_text(text)
            elif mig.exists():
                mig.unlink()
            args = ["run", "--config", str(cfg), "--simulate", "dgx-h100", "--sim-state", str(root / "sim.json"),
                    "--node-name", "e2e-mig-invalid"]
            with running_agent(tmp_path, root, args) as agent:
                assert agent.proc.wait(15) == 2, agent.log()
                lines = agent.log().splitlines()
                assert len(lines) == 1 and str(mig) in lines[0] and expected in lines[0], lines
            (tmp_path / "notify.sock").unlink()


def test_sighup_refuses_a_broken_mig_config_and_keeps_the_running_one(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness
) -> None:
    node = "e2e-run-mig-reload"
    make_node(kube_apiserver, node)

    def state() -> str | None:
        value: str | None = node_obj(kube_apiserver, node)["metadata"].get("labels", {}).get(
            "nvidia.com/mig.config.state")
        return value

    def apply(name: str) -> None:
        set_label(kube_apiserver, node, "nvidia.com/mig.config.state", None)
        set_label(kube_apiserver, node, "nvidia.com/mig.config", name)
        eventually(lambda: state() in ("success", "failed"), 60, f"mig.config={name} finished")

    with node_root(kubelet_harness) as root:
        cfg = agent_config(root, kube_apiserver.kubeconfig, '[mig]\nconfig_file = "/etc/nodeagent/mig.yaml"\n')
        mig = root / "etc/nodeagent/mig.yaml"
        mig.write_text(MIG_CONFIGS)
        args = ["run", "--config", str(cfg), "--simulate", "dgx-h100", "--sim-state", str(root / "sim.json"),
                "--node-name", node]
        with running_agent(tmp_path, root, args) as agent:
            agent.wait_notify("READY=1", timeout=20)
            apply("small")
            assert state() == "success", agent.log()
            # a broken edit: refused on SIGHUP, naming the file; the configs the agent runs with stay
            mig.write_text("version: v1\nmig-configs:\n  small: not-a-list\n")
            reload_and_wait(agent)
            rejected = [ln for ln in agent.log().splitlines() if "reload rejected" in ln]
            assert rejected and str(mig) in rejected[-1], agent.log()
            apply("whole")  # known only to the kept file contents
            assert state() == "success", agent.log()
            kubelet_harness.wait("nvidia.com/mig-7g.80gb", registered=True, total=8, timeout=20)
            # a good edit of the MIG file alone applies with SIGHUP: its new config name is known
            mig.write_text(MIG_CONFIGS + "  halves:\n  - devices: all\n    mig-enabled: true\n"
                           "    mig-devices:\n      3g.40gb: 2\n")
            reload_and_wait(agent)
            assert "reload: changed mig" in agent.log()
            set_label(kube_apiserver, node, "nvidia.com/mig.config", "halves")
            kubelet_harness.wait("nvidia.com/mig-3g.40gb", registered=True, total=16, timeout=30)
            eventually(lambda: state() == "success", 30, "mig.config.state=success for halves")
            assert "Traceback" not in agent.log()
            code, took = agent.stop()
            assert code == 0 and took < 5.0


UNREADABLE_CONFIGS = {
    "directory": "is a directory, expected a regular file",
    "fifo": "is a FIFO, expected a regular file",
    "deeply-nested": "nested too deeply",
    "huge": "bytes nodeagent reads",
}


def _make_unreadable(path: Path, case: str) -> None:
    import os

    if case == "directory":
        path.mkdir()
    elif case == "fifo":
        os.mkfifo(path)
    elif case == "deeply-nested":
        path.write_text("[metrics]\naddress = " + "[" * 5000 + "]" * 5000 + "\n")
    else:
        path.write_text("# padding\n" * 600_000)  # about 6 MB of comments: more than the reader takes


@pytest.mark.parametrize("case", sorted(UNREADABLE_CONFIGS))
def test_a_config_path_that_is_no_readable_toml_file_exits_2_in_one_line(tmp_path: Path, case: str) -> None:
    config = tmp_path / "config.toml"
    _make_unreadable(config, case)
    with node_root() as root, running_agent(tmp_path, root, demo_args(root, "--config", str(config))) as agent:
        assert agent.proc.wait(15) == 2, agent.log()
        lines = agent.log().splitlines()
        assert len(lines) == 1, lines  # one line: no usage text, no traceback
        assert lines[0].startswith(f"error: {config}") and UNREADABLE_CONFIGS[case] in lines[0], lines[0]


def test_sighup_with_a_fifo_in_place_of_the_config_is_refused_without_freezing_the_agent(
    tmp_path: Path, kubelet_harness: KubeletHarness
) -> None:
    import os

    config = tmp_path / "config.toml"
    config.write_text("resync_interval = 30\n")
    with node_root(kubelet_harness) as root, \
            running_agent(tmp_path, root, demo_args(root, "--config", str(config))) as agent:
        agent.wait_notify("READY=1")
        kubelet_harness.wait("nvidia.com/gpu", registered=True, total=8)
        config.unlink()
        os.mkfifo(config)  # nobody ever writes to it: a blocking read would hang for good
        reload_and_wait(agent)
        rejected = [ln for ln in agent.log().splitlines() if "reload rejected" in ln]
        assert rejected and str(config) in rejected[-1] and "FIFO" in rejected[-1], agent.log()
        # the loop still answers: a second SIGHUP with a good file again applies
        config.unlink()
        config.write_text("resync_interval = 45\n")
        reload_and_wait(agent)
        assert "reload: changed resync_interval" in agent.log()
        assert kubelet_harness.resource("nvidia.com/gpu").registered
        code, took = agent.stop()
        assert code == 0 and took < 5.0
