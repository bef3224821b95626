"""Render details found by the real containerd 2: `enable_cdi` per version (on by default from 2.0, removed
in 2.4), and byte preservation where tomlkit alone does not round-trip."""

from __future__ import annotations

import pytest
import tomlkit

from nodeagent.runtime import containerd as ctd
from nodeagent.runtime import containerd_toml as ctd_toml
from nodeagent.runtime import containerd_versions as ctd_versions
from nodeagent.runtime.containerd import Desired, render, render_dropin

V3 = """version = 3

[plugins."io.containerd.cri.v1.runtime"]
  enable_cdi = {cdi}

  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
"""
V3_NO_KEY = V3.replace("  enable_cdi = {cdi}\n", "")


@pytest.mark.parametrize(
    ("version", "old", "written"),
    [
        (None, V3_NO_KEY, True),  # containerd unknown: say it
        ((1, 7, 2), V3_NO_KEY, True),
        ((2, 1, 0), V3_NO_KEY, False),  # default on
        ((2, 1, 0), V3.format(cdi="false"), True),  # an explicit false must be overridden
        ((2, 3, 1), V3.format(cdi="false"), True),
        ((2, 4, 0), V3.format(cdi="false"), False),  # key removed: containerd ignores it
        ((2, 4, 2), V3_NO_KEY, False),
    ],
)
def test_enable_cdi_written_only_where_it_matters(version: ctd_versions.Version | None, old: str, written: bool) -> None:
    desired = Desired(enable_cdi=True, containerd_version=version)
    new = render(old, desired)
    assert ("enable_cdi = true" in new) is written
    assert ctd.view_of(new).binary_of("nvidia-cdi") == ctd.DEFAULT_CDI_BINARY
    assert render(new, desired) == new
    drop = render_dropin(old, desired).dropin_text
    assert ("enable_cdi = true" in drop) is written


# Two indented runtime tables under implicit parents (`containerd` and `runtimes` have no header): tomlkit
# alone renders the second header with its parent's indent added again.
NESTED = """version = 2

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.9"

  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"

  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.crun]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.crun.options]
      BinaryName = "/usr/bin/crun"
"""


def test_indented_siblings_under_implicit_tables_keep_their_bytes() -> None:
    assert tomlkit.dumps(ctd_toml.parse(NESTED)) == NESTED
    new = render(NESTED, Desired())
    assert new.startswith(NESTED.rstrip("\n"))
    assert render(new, Desired()) == new
    assert ctd.view_of(new).binary_of("nvidia") == ctd.DEFAULT_BINARY
