"""Property: for random valid containerd-like documents, rendering keeps validity and every untouched key."""

from __future__ import annotations

from typing import Any

import tomlkit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeagent.runtime import containerd as ctd
from nodeagent.runtime import containerd_toml as ctd_toml
from nodeagent.runtime import containerd_versions as ctd_versions

# Keys containerd reads with a type (imports, version, runtime_type, ...) are never drawn as random leaves: a
# random type there makes a file containerd refuses, which render refuses too (test_runtime_refused_types).
_TYPED = {*ctd_toml._TOP_TYPES, *ctd_toml._CRI_TYPES, *ctd_toml._CRI_CONTAINERD_TYPES, *ctd_toml._RUNTIME_TYPES}
_key = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-", min_size=1, max_size=8).filter(lambda k: k not in _TYPED)
_scalar = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**31), max_value=2**31),
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=12),
    st.lists(st.integers(min_value=0, max_value=9), max_size=3),
)
_leafy = st.dictionaries(_key, _scalar, max_size=4)
_runtime = st.fixed_dictionaries(
    {"runtime_type": st.sampled_from(["", ctd.RUNC_V2])},
    optional={"options": st.dictionaries(st.sampled_from(["SystemdCgroup", "Root", "BinaryName"]), _scalar,
                                         max_size=3)},
)


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    version = draw(st.sampled_from([1, 2, 3]))
    cri: dict[str, Any] = draw(_leafy)
    runtimes = draw(st.dictionaries(st.sampled_from(["runc", "crun", "kata", "gvisor"]), _runtime, max_size=3))
    containerd: dict[str, Any] = dict(draw(_leafy))
    if runtimes:
        containerd["runtimes"] = runtimes
    if draw(st.booleans()) and runtimes:
        containerd["default_runtime_name"] = draw(st.sampled_from(sorted(runtimes)))
    cri["containerd"] = containerd
    keys = ctd_versions.cri_path(version)
    doc: dict[str, Any] = {} if version == 1 else {"version": version}
    doc.update(draw(_leafy))
    doc.setdefault("plugins", {})
    if isinstance(doc["plugins"], dict):
        doc["plugins"][keys[1]] = cri
        doc["plugins"].update({"other": draw(_leafy)})
    else:
        doc["plugins"] = {keys[1]: cri}
    return doc


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents(), st.booleans(), st.booleans())
def test_render_keeps_validity_and_untouched_keys(doc: dict[str, Any], as_default: bool, cdi: bool) -> None:
    text = tomlkit.dumps(doc)
    desired = ctd.Desired(set_as_default=as_default, enable_cdi=cdi)
    new = ctd.render(text, desired)
    assert ctd.render(new, desired) == new
    parsed = tomlkit.parse(new).unwrap()  # still valid TOML
    old_leaves = dict(ctd.iter_keys(tomlkit.parse(text).unwrap()))
    new_leaves = dict(ctd.iter_keys(parsed))
    for path, value in old_leaves.items():
        if path[-1] in ("default_runtime_name", "enable_cdi"):
            continue
        assert new_leaves[path] == value, path
    view = ctd.view_of(new)
    assert view.binary_of("nvidia") == ctd.DEFAULT_BINARY
    dropped = ctd.render_dropin(text, desired)
    assert ctd.view_of(dropped.dropin_text).binary_of("nvidia") == ctd.DEFAULT_BINARY
