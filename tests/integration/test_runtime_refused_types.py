"""containerd configs that containerd itself refuses for a value's type are refused by nodeagent too, naming the
key, with nothing written: the real containerd (Debian's) is the judge of each case."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nodeagent.errors import ConfigError
from nodeagent.runtime import configure as rc
from tests.integration._containerd import Case, StatePaths
from tests.peers.containerd import Containerd, ContainerdConfigError

pytestmark = pytest.mark.peers

CRI = 'plugins."io.containerd.grpc.v1.cri"'
# (config text, the key the refusal names)
REFUSED = [
    ("version = 2\nimports = [1, 2]\n", "imports"),
    (
        f"version = 2\n[{CRI}.containerd]\ndefault_runtime_name = 5\n",
        f"{CRI}.containerd.default_runtime_name",
    ),
    ("version = 2\nplugins = [1, 2]\n", "plugins"),
    ("version = 2\n[plugins]\ncri = 5\n", "plugins.cri"),
    (f"version = 2\n[{CRI}.containerd.runtimes]\nrunc = 5\n", f"{CRI}.containerd.runtimes.runc"),
    (
        f"version = 2\n[{CRI}.containerd.runtimes.runc]\nruntime_type = 5\n",
        f"{CRI}.containerd.runtimes.runc.runtime_type",
    ),
    (
        f"version = 2\n[{CRI}.containerd.runtimes.runc]\noptions = 5\n",
        f"{CRI}.containerd.runtimes.runc.options",
    ),
    ("version = 2\nroot = 5\n", "root"),
    ('version = 2\noom_score = "x"\n', "oom_score"),
    ("version = 2\ndisabled_plugins = [1]\n", "disabled_plugins"),
]


@pytest.mark.parametrize("mode", ["auto", "in-place"])
@pytest.mark.parametrize(("text", "key"), REFUSED)
def test_what_containerd_refuses_is_refused_naming_the_key(
    containerd: Containerd, tmp_path: Path, text: str, key: str, mode: rc.Mode
) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    config = etc / "config.toml"
    config.write_text(text)
    with pytest.raises(ContainerdConfigError):  # the judge: containerd will not load this file
        containerd.config_dump(config)
    case = Case(
        StatePaths(Path("/"), state=tmp_path / "state"),
        config,
        etc / "conf.d" / "99-nvidia.toml",
        tmp_path / "toolkit.toml",
        config.read_bytes(),
    )
    with pytest.raises(ConfigError) as err:
        rc.configure(case.paths, case.options(mode, set_as_default=True))
    msg = str(err.value)
    assert re.search(rf": {re.escape(key)} must be an? ", msg) and "\n" not in msg, msg
    assert config.read_bytes() == text.encode()
    assert not case.dropin.exists()
