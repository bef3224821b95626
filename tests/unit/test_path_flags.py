"""The one rule for path flags (docs/configuration.md, README's sandbox bullets), checked for every path flag
of the CLI under ``--root r``:

- a file or directory of the node, which nodeagent writes, serves or keeps (``node``), must lie inside the
  root: one path out of it is one error line naming the flag, exit 2, nothing made;
- a file of yours that the command only reads as its input or writes as its report (``user``) may be
  anywhere, as your shell names it: it is used there, never looked for under the root;
- the host-style names (``name``: ``--driver-root``, ``--binary``, ``--root-on-host``) are paths as the node
  names them, never paths of this machine, and ``--containerd-binary`` is refused under a root (it would be
  executed).

A path flag added to the CLI without a row here fails ``test_every_path_flag_has_a_rule``.
"""

from __future__ import annotations

import os
from pathlib import Path

import click
import pytest

from nodeagent.cli import cli, main

REPO = Path(__file__).resolve().parents[2]
SIM = ("--simulate", "t4x1")
# (command words, flag, kind, arguments before the flag's value, arguments after it)
FLAGS: list[tuple[str, str, str, tuple[str, ...], tuple[str, ...]]] = [
    ("run", "--sim-state", "node", ("--simulate", "t4x1", "--no-kube"), ()),
    ("run", "--kubelet-dir", "node", (*SIM, "--no-kube"), ()),
    ("run", "--pod-resources-socket", "node", (*SIM, "--no-kube"), ()),
    ("run", "--device-plugin-config", "node", (*SIM, "--no-kube"), ()),
    ("bootstrap", "--sim-state", "node", ("--simulate", "t4x1", "--no-kube"), ()),
    ("discover", "--sim-state", "node", SIM, ()),
    ("doctor", "--sim-state", "node", (*SIM, "--no-kube"), ()),
    ("mig plan", "--sim-state", "node", SIM, ()),
    ("mig apply", "--sim-state", "node", SIM, ("-c", "all-disabled")),
    ("mig assert", "--sim-state", "node", SIM, ("-c", "all-disabled")),
    ("mig export", "--sim-state", "node", SIM, ()),
    ("cdi generate", "--sim-state", "node", SIM, ()),
    ("cdi show", "--sim-state", "node", SIM, ()),
    ("sim show", "--sim-state", "node", SIM, ()),
    ("sim mig", "--sim-state", "node", SIM, ("--gpu", "0", "--disable")),
    ("sim reboot", "--sim-state", "node", SIM, ()),
    ("sim inject xid", "--sim-state", "node", SIM, ("--gpu", "0", "--code", "48")),
    ("sim inject lost", "--sim-state", "node", SIM, ("--gpu", "0")),
    ("sim inject process", "--sim-state", "node", SIM, ("--gpu", "0", "--pid", "9")),
    ("sim inject kill", "--sim-state", "node", SIM, ("--gpu", "0")),
    ("sim inject compute-mode", "--sim-state", "node", SIM, ("--gpu", "0", "DEFAULT")),
    ("sim inject persistence", "--sim-state", "node", SIM, ("enabled",)),
    ("sim inject recover", "--sim-state", "node", SIM, ()),
    ("sim inject fail-next", "--sim-state", "node", SIM, ("--function", "nvmlInit", "--code", "1")),
    ("sim fabric", "--sim-state", "node", ("--simulate", "gb200-nvl"), ("--clique", "2")),
    ("sim inject fabric", "--sim-state", "node", ("--simulate", "gb200-nvl"), ("--state", "in-progress")),
    ("runtime configure", "--containerd-config", "node", (), ()),
    ("runtime configure", "--drop-in", "node", (), ()),
    ("runtime configure", "--socket", "node", (), ()),
    ("runtime unconfigure", "--socket", "node", (), ()),
    ("runtime show", "--containerd-config", "node", (), ()),
    ("run", "--config", "user", (*SIM, "--sim-state", "r/s.json", "--no-kube"), ()),
    ("bootstrap", "--config", "user", (*SIM, "--no-kube"), ()),
    ("doctor", "--config", "user", (*SIM, "--no-kube"), ()),
    ("run", "--kubeconfig", "user", (*SIM, "--sim-state", "r/s.json"), ()),
    ("adopt", "--kubeconfig", "user", (), ()),
    ("controller", "--kubeconfig", "user", (), ()),
    ("fleet status", "--kubeconfig", "user", (), ()),
    ("fleet clear-brake", "--kubeconfig", "user", (), ("pool-a",)),
    ("runtime configure", "--kubeconfig", "user", (), ()),
    ("bootstrap", "--kubeconfig", "user", SIM, ()),
    ("doctor", "--kubeconfig", "user", SIM, ()),
    ("mig plan", "-f", "user", SIM, ()),
    ("mig apply", "-f", "user", SIM, ()),
    ("mig assert", "-f", "user", SIM, ()),
    ("mig apply", "--hooks-file", "user", SIM, ("-c", "all-disabled")),
    ("bootstrap", "--output", "user", (*SIM, "--no-kube"), ()),
    ("doctor", "--containerd-binary", "executed", (*SIM, "--no-kube"), ()),
    ("", "--root", "name", (), ()),
    ("", "--root-on-host", "name", (), ()),
    ("cdi generate", "--driver-root", "name", (), ()),
    ("cdi show", "--driver-root", "name", (), ()),
    ("cdi list", "--driver-root", "name", (), ()),
    ("runtime configure", "--binary", "name", (), ()),
]
# string options that name paths (the click.Path ones are found by their type)
STRING_PATHS = {"--containerd-config", "--drop-in", "--socket", "--config-file", "--driver-root", "--binary",
                "--root-on-host"}
# input the command reads and refuses for what it holds (so the refusal names where it was read)
# (a --kubeconfig is given missing: the error names where it was looked for)
BAD = {"--config": "x = [\n", "-f": "a: [\n", "--hooks-file": "a: [\n"}


def _walk(group: click.Group, ctx: click.Context, words: tuple[str, ...]) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None
        path = (*words, name)
        for p in cmd.params:
            if not isinstance(p, click.Option) or p.opts == ["--root"]:  # every command's copy of the global
                continue
            long = [o for o in p.opts if o.startswith("--")]
            flag = p.opts[0] if p.opts[0] == "-f" else long[0]
            if isinstance(p.type, click.Path) or set(p.opts) & STRING_PATHS:
                found.add((" ".join(path), flag))
        if isinstance(cmd, click.Group):
            found |= _walk(cmd, click.Context(cmd, parent=ctx, info_name=name), path)
    return found


def test_every_path_flag_has_a_rule() -> None:
    ctx = click.Context(cli, info_name="nodeagent")
    found = _walk(cli, ctx, ())
    found |= {("", "--root"), ("", "--root-on-host")}
    assert found == {(c, f) for c, f, *_ in FLAGS}


def test_the_rule_is_stated_once_in_the_docs_with_every_flag() -> None:
    docs = (REPO / "docs/configuration.md").read_text()
    rule = docs[docs.index("Path flags"):]
    for _, flag, kind, *_ in FLAGS:
        if kind != "name" or flag not in ("--root",):
            assert f"`{flag}" in rule, flag
    assert "docs/configuration.md" in (REPO / "README.md").read_text().split("## Commands")[0]


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return int(e.value.code or 0), out.out + out.err


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test's directory as the working directory, with an empty root ``r`` in it and the default sandbox
    (``$XDG_RUNTIME_DIR``) kept inside it too."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    (tmp_path / "r").mkdir()
    return tmp_path


def _tree(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


@pytest.mark.parametrize(("command", "flag", "before", "after"),
                         [(c, f, b, a) for c, f, k, b, a in FLAGS if k == "node"],
                         ids=[f"{c} {f}" for c, f, k, *_ in FLAGS if k == "node"])
def test_a_node_path_out_of_the_root_is_one_error_line(
    in_tmp: Path, capsys: pytest.CaptureFixture[str],
    command: str, flag: str, before: tuple[str, ...], after: tuple[str, ...],
) -> None:
    tmp_path = in_tmp
    value = "r/../elsewhere/x" if flag != "--kubelet-dir" else "r/../elsewhere"
    code, out = _run(capsys, ["--root", "r", *command.split(), *before, flag, value, *after])
    assert code == 2, out
    line = [ln for ln in out.splitlines() if ln.strip()]
    assert len(line) == 1 and flag in line[0] and "is not inside --root" in line[0], out
    assert _tree(tmp_path) == ["r"]  # nothing made, in the root or beside it


@pytest.mark.parametrize(("command", "flag", "before", "after"),
                         [(c, f, b, a) for c, f, k, b, a in FLAGS if k == "user"],
                         ids=[f"{c} {f}" for c, f, k, *_ in FLAGS if k == "user"])
def test_a_user_file_out_of_the_root_is_used_where_it_is(
    in_tmp: Path, capsys: pytest.CaptureFixture[str],
    command: str, flag: str, before: tuple[str, ...], after: tuple[str, ...],
) -> None:
    tmp_path = in_tmp
    (tmp_path / "mine").mkdir()
    mine = tmp_path / "mine/file"
    if flag in BAD:
        mine.write_text(BAD[flag])
    code, out = _run(capsys, ["--root", "r", *command.split(), *before, flag, "mine/file", *after])
    assert "not inside --root" not in out, out
    if flag == "--output":
        assert code == 0 and '"steps"' in mine.read_text(), out  # the report, written where asked
    else:  # read there (or looked for there), and refused for what it holds (or for being missing)
        assert (str(mine) in out or "mine/file" in out), out
        assert code != 0 or (flag == "--kubeconfig" and command == "bootstrap"), out  # a failed step
    assert not (tmp_path / "r/mine").exists() and not (tmp_path / "r" / str(mine).lstrip("/")).exists()


def test_a_node_path_inside_the_root_is_taken_and_its_directory_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The README's ``run`` line in a fresh directory: the state file's directory is made (in the root)."""
    monkeypatch.chdir(tmp_path)
    code, out = _run(capsys, ["--root", "demo", "discover", "--simulate", "t4x1", "--sim-state", "demo/a/sim.json"])
    assert code == 0, out
    assert (tmp_path / "demo/a/sim.json").is_file()
    os.symlink(str(tmp_path / "elsewhere"), tmp_path / "demo/b")  # followed inside the root, as a chroot would
    code, out = _run(capsys, ["--root", "demo", "discover", "--simulate", "t4x1", "--sim-state", "demo/b/sim.json"])
    assert code == 0, out
    assert (tmp_path / "demo" / str(tmp_path / "elsewhere").lstrip("/") / "sim.json").is_file()
    assert not (tmp_path / "elsewhere").exists()
