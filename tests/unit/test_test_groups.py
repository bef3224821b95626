"""The suite's own grouping of test files for the workers (tests/conftest.py) names what it must: every file
that uses the shared API servers of the Kubernetes releases is in their group, and no other."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import HOST_OWNED, RELEASES, RELEASES_FILES, scope_of

REPO = Path(__file__).resolve().parents[2]


def test_every_file_on_the_shared_release_servers_is_in_their_group() -> None:
    users = sorted(str(p.relative_to(REPO)) for p in REPO.glob("tests/**/test_*.py")
                   if any(line.startswith("from tests.integration._releases import")
                          and "shared_release_apiserver" in line for line in p.read_text().splitlines()))
    assert users == sorted(RELEASES_FILES)
    for path in users:
        assert scope_of(f"{path}::test_x[v1.36.3]") == RELEASES


def test_other_files_keep_a_scope_of_their_own() -> None:
    assert scope_of("tests/unit/test_cdi.py::test_x") == "tests/unit/test_cdi.py"
    assert scope_of("tests/cluster/test_whole_node.py::test_x") == HOST_OWNED
