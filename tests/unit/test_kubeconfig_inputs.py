"""A kubeconfig that is not one: each is a single error line naming the file, exit 2, before the kubernetes
client reads it (its loader answered these with a TypeError or a RecursionError), from every command that
takes ``--kubeconfig``."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent.cli import main
from nodeagent.errors import ConfigError
from nodeagent.kube.client import connect
from nodeagent.kube.kubeconfig import read_kubeconfig

LINE_MAX = 400
GOOD = (
    "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
    "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:1'}}]\n"
    "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("hello\n", "is the value 'hello', not a mapping"),
        ("- a\n- b\n", "is a list, not a mapping"),
        ("apiVersion: v1\x00\n", "not valid YAML: unacceptable character #x0000"),
        ("[" * 100_000 + "]" * 100_000, "nested more than 32 levels deep"),
        ("!!python/object:os.system {}\n", "could not determine a constructor"),
        ("? [a, b]\n: c\n", "found unhashable key"),
        ("a: 1\n---\nb: 2\n", "but found another document"),
        ("a: " + "x" * 2_000_000 + "\n", "more than the 1048576 bytes nodeagent reads"),
        ("", "is empty"),
        ("1: x\n", "the top level has a key that is not a string: 1"),
        ("clusters: hello\n", "clusters must be a list, got the value 'hello'"),
        ("contexts: [{}]\n", "contexts[0]: 'name' must be a non-empty string, got None"),
        ("contexts: [5]\n", "contexts[0] must be a mapping with 'name' and 'context'"),
        ("current-context: [a]\n", "current-context must be a string, got ['a']"),
        ("clusters: [{name: k, cluster: {server: 5}}]\n", "clusters[0] (k).cluster.server must be a string, got 5"),
        ("users: [{name: u, user: {exec: {command: x, args: [1]}}}]\n",
         "users[0] (u).user.exec.args must be a list of strings"),
        ("users: [{name: u, user: {exec: {command: x, env: [{name: A}]}}}]\n",
         "users[0] (u).user.exec.env[0] must be a mapping with a string 'name' and 'value'"),
        ("users: [{name: u, user: {auth-provider: {name: oidc, config: {a: [1]}}}}]\n",
         "users[0] (u).user.auth-provider.config.a must be a string"),
        ('users: [{name: u, user: {token: "a\\0b"}}]\n', "users[0].user.token holds a NUL byte"),
        ("clusters: [{name: " + "k" * 300_000 + ", cluster: 7}]\n", "cluster must be a mapping, got the value 7"),
    ],
)
def test_a_bad_kubeconfig_is_one_line_naming_the_file(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "kc"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        connect(path)
    msg = str(err.value)
    assert msg.startswith(f"kubeconfig {path}: ") and expected in msg, msg[:500]
    assert "\n" not in msg and len(msg) <= LINE_MAX, msg[:500]
    assert err.value.exit_code == 2


def test_a_fifo_is_refused_at_once_and_a_sound_kubeconfig_still_loads(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"^kubeconfig .*/fifo: is a FIFO, expected a regular file$"):
        connect(fifo)
    path = tmp_path / "kc"
    path.write_text(GOOD + "users: [{name: u, user: {token: t, exec: null}}]\npreferences: {}\n")
    assert read_kubeconfig(path)["current-context"] == "c"
    assert connect(path).configuration.host == "https://127.0.0.1:1"


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    out = capsys.readouterr()
    return int(e.value.code or 0), out.out + out.err


@pytest.mark.parametrize("command", ["adopt", "run", "bootstrap", "doctor", "runtime configure"])
def test_every_command_says_the_kubeconfig_is_bad_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    kc = tmp_path / "kc"
    kc.write_text("[" * 100_000)
    root = tmp_path / "root"
    sim = ["--simulate", "t4x1"]
    args = {
        "adopt": ["adopt", "--node-name", "n"],
        "run": ["run", *sim, "--metrics-address", ""],
        "bootstrap": ["bootstrap", *sim, "--no-restart"],
        "doctor": ["doctor", *sim],
        "runtime configure": ["runtime", "configure"],
    }[command]
    code, out = _cli(capsys, "--root", str(root), *args, "--kubeconfig", str(kc))
    assert "Traceback" not in out and "RecursionError" not in out, out[-2000:]
    lines = [ln for ln in out.splitlines() if f"kubeconfig {kc}: nested more than 32 levels deep" in ln]
    assert len(lines) == 1 and len(lines[0]) <= LINE_MAX, out[-2000:]
    if command == "doctor":  # a finding among the others (doctor's exit code 1: a warning)
        assert code == 1 and lines[0].startswith("warning node "), out[-2000:]
    else:  # refused before anything is done
        assert code == 2 and out.strip() == lines[0] and lines[0].startswith("error: "), out[-2000:]
        assert not (root / "etc/containerd").exists() and not (root / "var/run/cdi").exists()
