"""IMEX channel devices under a sandbox root, their CDI entries, and the daemon's config/nodes files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from nodeagent.errors import ConfigError, InputError
from nodeagent.hostpaths import HostPaths
from nodeagent.imex import channels, daemonconfig

PROC = "Character devices:\n195 nvidia-frontend\n237 nvidia-caps-imex-channels\n\nBlock devices:\n  8 sd\n"


def _root(tmp_path: Path, proc: str = PROC) -> HostPaths:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/devices").write_text(proc)
    return HostPaths(tmp_path)


def test_channel_made_with_major_from_proc_devices(tmp_path: Path) -> None:
    paths = _root(tmp_path)
    ch = channels.ensure_channel(paths, 0)
    assert (ch.path, ch.major, ch.minor) == ("/dev/nvidia-caps-imex-channels/channel0", 237, 0)
    made = tmp_path / "dev/nvidia-caps-imex-channels/channel0"
    assert ch.host_path == str(made)
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o666
    assert channels.existing_channel(paths, 0) and not channels.existing_channel(paths, 1)
    # idempotent; a second channel shares the major
    assert channels.ensure_channel(paths, 0) == ch
    assert [c.minor for c in channels.ensure_channels(paths, [3, 1, 3])] == [1, 3]


def test_cdi_entries_name_channels_like_nvidias_plugin(tmp_path: Path) -> None:
    paths = _root(tmp_path)
    spec = channels.cdi_spec(channels.ensure_channels(paths, [1, 0]))
    assert spec is not None and spec["kind"] == "nvidia.com/imex-channel"
    assert [d["name"] for d in spec["devices"]] == ["0", "1"]
    node = spec["devices"][1]["containerEdits"]["deviceNodes"][0]
    assert node == {"path": "/dev/nvidia-caps-imex-channels/channel1",
                    "hostPath": str(tmp_path / "dev/nvidia-caps-imex-channels/channel1"),
                    "type": "c", "major": 237, "minor": 1, "fileMode": 0o666}
    assert channels.qualified_name(0) == "nvidia.com/imex-channel=0"
    assert channels.cdi_spec([]) is None


def test_no_imex_major_is_one_clear_error(tmp_path: Path) -> None:
    paths = _root(tmp_path, "Character devices:\n195 nvidia-frontend\n")
    with pytest.raises(channels.ImexChannelError, match="nvidia-caps-imex-channels"):
        channels.ensure_channel(paths, 0)
    assert not (tmp_path / "dev/nvidia-caps-imex-channels/channel0").exists()


@pytest.mark.parametrize("bad", [-1, 1 << 20, True, "0"])
def test_bad_channel_number(tmp_path: Path, bad: object) -> None:
    with pytest.raises(InputError, match="IMEX channel number"):
        channels.ensure_channel(_root(tmp_path), bad)  # type: ignore[arg-type]


def test_stand_in_replaced_by_file_when_something_else_is_there(tmp_path: Path) -> None:
    paths = _root(tmp_path)
    (tmp_path / "dev/nvidia-caps-imex-channels/channel2").mkdir(parents=True)
    (tmp_path / "dev/nvidia-caps-imex-channels/channel2").rmdir()
    os.symlink("/etc/passwd", tmp_path / "dev/nvidia-caps-imex-channels/channel2")
    channels.ensure_channel(paths, 2)
    assert stat.S_ISREG(os.lstat(tmp_path / "dev/nvidia-caps-imex-channels/channel2").st_mode)


def test_daemon_config_keys_and_nodes_file() -> None:
    s = daemonconfig.DaemonSettings(bind_ip="10.0.0.2")
    keys = daemonconfig.parse_config(daemonconfig.render_config(s))
    assert keys["IMEX_CMD_ENABLED"] == "1" and keys["IMEX_CMD_UNIX_DOMAIN_PATH"] == "/etc/nvidia-imex/imex_ctrl.sock"
    assert keys["SERVER_PORT"] == "50000" and keys["IMEX_CMD_PORT"] == "50005"
    assert keys["BIND_INTERFACE_IP"] == "10.0.0.2" and keys["IMEX_WAIT_FOR_QUORUM"] == "RECOVERY"
    assert keys["IMEX_NODE_CONFIG_FILE"] == "/etc/nvidia-imex/nodes_config.cfg" and keys["DAEMONIZE"] == "0"
    members = daemonconfig.clique_members({"b": "10.0.0.10", "a": "10.0.0.2", "c": None, "d": "junk"},
                                          "a", "10.0.0.2")
    assert members == ["10.0.0.2", "10.0.0.10"]
    text = daemonconfig.render_nodes(["10.0.0.10", "10.0.0.2", "10.0.0.2"])
    assert text == "10.0.0.2\n10.0.0.10\n"
    assert daemonconfig.parse_nodes("# c\n" + text + "bad\n") == ["10.0.0.2", "10.0.0.10"]
    change = daemonconfig.membership_change(["10.0.0.2", "10.0.0.10"], ["10.0.0.2", "10.0.0.11"])
    assert change.added == ("10.0.0.11",) and change.removed == ("10.0.0.10",) and change.changed
    with pytest.raises(ConfigError, match="not an IP address"):
        daemonconfig.check_address("10.0.0", "imex.bind_ip")
