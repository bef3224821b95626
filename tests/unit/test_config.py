"""Agent config: defaults, the shipped example, overrides and errors naming key and file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nodeagent.config import AgentConfig, KubeletSettings, apply_overrides, load_config, parse_config
from nodeagent.errors import ConfigError
from nodeagent.hostpaths import KUBELET_DIR, HostPaths

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "config.toml"


def test_missing_default_file_gives_defaults(tmp_path: Path) -> None:
    cfg = load_config(HostPaths(tmp_path))
    assert cfg == AgentConfig()
    assert cfg.source == "defaults"


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(HostPaths(tmp_path), tmp_path / "nope.toml")


def test_default_file_is_read_under_root(tmp_path: Path) -> None:
    f = tmp_path / "etc/nodeagent/config.toml"
    f.parent.mkdir(parents=True)
    f.write_text('node_name = "gpu-7"\n[mig]\nwith_reboot = true\n')
    cfg = load_config(HostPaths(tmp_path))
    assert cfg.node_name == "gpu-7"
    assert cfg.mig.with_reboot is True
    assert cfg.source == str(f)


def test_example_uncommented_equals_defaults() -> None:
    """The example documents every key with its default: uncommenting all of it changes nothing."""
    lines = []
    for line in EXAMPLE.read_text().splitlines():
        m = re.match(r'^# ([a-z_]+ = (?:".*"|[0-9.]+|true|false|\[[0-9, ]*\]|\{\}))$', line)
        if m:
            lines.append(m.group(1))
        elif line.startswith("["):
            lines.append(line)
    cfg = parse_config("\n".join(lines), "example")
    assert cfg == AgentConfig()
    # and it names every key the dataclasses have
    keys = {ln.split(" = ")[0] for ln in lines if " = " in ln}
    import dataclasses

    def names(cls: type) -> set[str]:
        out: set[str] = set()
        for f in dataclasses.fields(cls):
            if f.name == "source":
                continue
            sub = f.default_factory
            if sub is not dataclasses.MISSING and dataclasses.is_dataclass(sub):
                out |= names(sub)
            else:
                out.add(f.name)
        return out

    assert names(AgentConfig) == keys


def test_example_as_shipped_parses() -> None:
    assert parse_config(EXAMPLE.read_text(), str(EXAMPLE)) == AgentConfig()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("colour = 1", "unknown key 'colour'"),
        ("[mig]\nwith_rebot = true", "unknown key 'mig.with_rebot'"),
        ("[mig]\nwith_reboot = 'yes'", "key 'mig.with_reboot' must be true or false"),
        ("[runtime]\nmode = 'sideways'", "key 'runtime.mode' must be one of"),
        ("resync_interval = 0", "key 'resync_interval' must be greater than 0"),
        ("[metrics]\naddress = 'localhost'", "key 'metrics.address'"),
        ("[metrics]\naddress = 'localhost:99999'", "port out of range"),
        ("[kubelet]\ndir = 'var/lib/kubelet'", "must be an absolute path"),
        ("mig = 3", "key 'mig' must be a table"),
        ("node_name = 'a b'", "not a valid node name"),
        ("[mig", "not valid TOML"),
        ("[publish]\nlabels = 'nfd'", "key 'publish.labels' must be one of true, false, 'node', 'nodefeature'"),
        ("[publish]\nlabels = 1", "key 'publish.labels' must be one of"),
        ("[publish]\nnodefeature_namespace = 'Node Agent'", "key 'publish.nodefeature_namespace' is not a namespace"),
    ],
)
def test_bad_input_names_key_and_file(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config(HostPaths(tmp_path), f)
    assert needle in str(ei.value)
    assert str(f) in str(ei.value)
    assert ei.value.exit_code == 2


def test_flags_override_file(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('node_name = "file"\n[kubelet]\ndir = "/k"\n[metrics]\naddress = "127.0.0.1:1"\n')
    cfg = load_config(
        HostPaths(tmp_path),
        f,
        {"node_name": "flag", "kubelet.dir": None, "metrics.address": "127.0.0.1:9400", "mig.with_reboot": True},
    )
    assert cfg.node_name == "flag"
    assert cfg.kubelet.dir == "/k"  # None = flag not given
    assert cfg.metrics.host_port() == ("127.0.0.1", 9400)
    assert cfg.mig.with_reboot is True
    assert cfg.source == str(f)


def test_bad_override_names_the_command_line() -> None:
    with pytest.raises(ConfigError, match=r"command line: key 'metrics\.address'"):
        apply_overrides(AgentConfig(), {"metrics.address": "nope"})


def test_ipv6_address_and_sections_changed() -> None:
    a = AgentConfig()
    b = apply_overrides(a, {"metrics.address": "[::1]:9400", "log_level": "debug"})
    assert b.metrics.host_port() == ("::1", 9400)
    assert a.sections_changed(b) == {"metrics", "log_level"}


def test_node_name_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "from-env")
    assert AgentConfig().resolved_node_name() == "from-env"
    assert AgentConfig(node_name="set").resolved_node_name() == "set"


def test_kubelet_dir_default_is_the_one_host_constant() -> None:
    """Every default kubelet directory (config, runtime options, the DRA plane) is ``KUBELET_DIR``."""
    assert KubeletSettings().dir == KUBELET_DIR


@pytest.mark.parametrize(("value", "through"), [("true", False), ("false", False), ('"node"', False),
                                                ('"nodefeature"', True)])
def test_labels_go_to_the_node_or_a_node_feature(value: str, through: bool) -> None:
    cfg = parse_config(f"[publish]\nlabels = {value}\n", "t")
    assert cfg.publish.through_nodefeature is through
    assert bool(cfg.publish.labels) is (value != "false")
