"""Failures a newcomer meets are one line each, never a traceback: a component that cannot start, missing
Kubernetes credentials, a kubeconfig that is not there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e._agent import REPO

NODEAGENT = [sys.executable, "-m", "nodeagent"]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory: the sandboxes below it hold Unix sockets (107 bytes at most for their paths)."""
    with tempfile.TemporaryDirectory(prefix="na1l-", dir="/tmp") as d:
        yield Path(d)


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("NODEAGENT_", "KUBERNETES_", "KUBECONFIG"))
    }
    env.update(HOME=str(tmp / "home"), XDG_RUNTIME_DIR=str(tmp / "xdg"), PYTHONPATH=str(REPO), **extra)
    return env


# root without the capabilities that let it pass file permissions: a directory another user owns with mode
# 0700 is closed to it (running as another user instead would need every path to the interpreter open)
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--inh-caps=-all"]
NOBODY = 65534


def _na(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``nodeagent ARGS`` run to its end from ``tmp``."""
    return subprocess.run(
        [*NODEAGENT, *args], cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=120, check=False
    )


def _run_until(tmp: Path, args: list[str], line: str, env: dict[str, str], timeout: float = 60) -> str:
    """Start ``nodeagent ARGS``, wait for ``line`` in its log, stop it with SIGINT; the whole log."""
    log = tmp / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([*NODEAGENT, *args], cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while line not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    return log.read_text()


def test_component_failing_to_start_is_one_line(short_tmp: Path) -> None:
    root = short_tmp / "demo"
    root.mkdir()
    (root / "proc").write_text("a file where the simulator lays out its /proc\n")
    text = _run_until(
        short_tmp,
        ["--root", str(root), "run", "--simulate", "dgx-h100", "--no-kube", "--metrics-address", ""],
        "component cdi failed to start",
        _env(short_tmp),
    )
    lines = [ln for ln in text.splitlines() if "component cdi failed to start" in ln]
    assert len(lines) == 1, text
    assert "Error" in lines[0] and "(retried on the next resync)" in lines[0], lines
    assert "Traceback" not in text, text
    assert "component device-plugin started" in text, text  # the rest of the agent goes on


def test_no_credentials_names_every_place_tried(short_tmp: Path) -> None:
    (short_tmp / "home").mkdir()
    r = _na(short_tmp, "--root", str(short_tmp / "demo"), "bootstrap", "--simulate", "t4x1")
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    out = r.stdout + r.stderr
    assert (
        "no Kubernetes credentials; tried in-cluster service account (KUBERNETES_SERVICE_HOST is not set"
        in out
    )
    assert "$KUBECONFIG (not set)" in out and f"{short_tmp}/home/.kube/config (not found)" in out, out


def test_kubeconfig_from_the_environment_and_home_like_kubectl(short_tmp: Path) -> None:
    """Outside a pod the agent looks where kubectl does: $KUBECONFIG, then ~/.kube/config."""
    from nodeagent.errors import KubeError
    from nodeagent.kube.client import connect

    cfg = short_tmp / "kc.yaml"
    cfg.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\nusers: [{name: u, user: {token: t}}]\n"
    )
    saved = {k: os.environ.get(k) for k in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "HOME")}
    try:
        os.environ.pop("KUBERNETES_SERVICE_HOST", None)
        os.environ["KUBECONFIG"] = f"{cfg}{os.pathsep}/elsewhere"
        assert connect().configuration.host == "https://127.0.0.1:1"
        os.environ.pop("KUBECONFIG")
        os.environ["HOME"] = str(short_tmp)
        (short_tmp / ".kube").mkdir()
        (short_tmp / ".kube/config").write_text(cfg.read_text())
        assert connect().configuration.host == "https://127.0.0.1:1"
        with pytest.raises(KubeError, match=r"^kubeconfig /nonexistent/kc: not found$"):
            connect(Path("/nonexistent/kc"))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_missing_kubeconfig_flag_says_not_found(short_tmp: Path) -> None:
    r = _na(
        short_tmp,
        "--root",
        str(short_tmp / "demo"),
        "run",
        "--simulate",
        "t4x1",
        "--kubeconfig",
        "/nonexistent/kc",
        "--metrics-address",
        "",
    )
    assert r.returncode != 0 and r.stderr == "error: kubeconfig /nonexistent/kc: not found\n", r.stderr


def test_start_up_errors_are_json_with_log_format_json(short_tmp: Path) -> None:
    for args, code, text in (
        (
            [
                "--log-format",
                "json",
                "--root",
                str(short_tmp / "d"),
                "run",
                "--simulate",
                "t4x1",
                "--kubeconfig",
                "/nonexistent/kc",
            ],
            1,
            "kubeconfig /nonexistent/kc: not found",
        ),
        (["--log-format=json", "run", "--no-such-option"], 2, "No such option: --no-such-option"),
    ):
        r = _na(short_tmp, *args)
        assert r.returncode == code, r.stderr
        (line,) = r.stderr.splitlines()
        doc = json.loads(line)
        assert doc["level"] == "error" and doc["exit_code"] == code, doc
        assert text.replace(": --", " '--") in doc["msg"] or text in doc["msg"], doc


def test_a_failed_bootstrap_step_is_logged_as_an_error(short_tmp: Path) -> None:
    root = short_tmp / "demo"
    (root / "etc/containerd").mkdir(parents=True)
    (root / "etc/containerd/config.toml").write_text("version = 2\n[plugins\n")  # not TOML: the step fails
    r = _na(short_tmp, "--root", str(root), "bootstrap", "--simulate", "t4x1", "--no-kube")
    assert r.returncode == 2, r.stderr
    failed = [line for line in r.stderr.splitlines() if " runtime: failed" in line]
    assert len(failed) == 1 and " ERROR " in failed[0], r.stderr
    report = json.loads(r.stdout)
    # the steps that do not depend on the failed one still ran: the CDI spec is written
    steps = {s["step"]: s["result"] for s in report["steps"]}
    assert steps["runtime"] == "failed" and steps["cdi"] == "changed", steps


def test_home_hidden_by_the_unit_sandbox_is_named_in_the_credentials_error(short_tmp: Path) -> None:
    """Under systemd, ProtectHome= makes the home directory unreadable: looking for ~/.kube/config answers
    EACCES, not "no such file". One error naming it, as for a missing file (here: a caller that may not
    enter the home directory)."""
    home = short_tmp / "home"
    home.mkdir(mode=0o700)
    os.chown(home, NOBODY, NOBODY)
    code = "from nodeagent.kube.client import connect\nconnect()\n"
    r = subprocess.run(
        [*NO_DAC, sys.executable, "-c", code],
        env=_env(short_tmp),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("nodeagent.errors.KubeError: no Kubernetes credentials"), r.stderr
    assert f"{home}/.kube/config (cannot look: Permission denied)" in lines[-1], r.stderr
    assert "PermissionError" not in r.stderr, r.stderr


def test_mig_apply_without_the_rights_to_its_state_is_one_line(short_tmp: Path) -> None:
    """A command that may not enter the MIG state directory: one error line naming it, exit 1, no GPU
    changed."""
    root = short_tmp / "r"
    state_dir = root / "var/lib/nodeagent/mig"
    state_dir.mkdir(parents=True)
    (root / "var/lib/nodeagent").chmod(0o700)
    os.chown(root / "var/lib/nodeagent", NOBODY, NOBODY)  # another user's, closed to the command below
    sim = root / "sim.json"
    args = [
        "--root",
        str(root),
        "mig",
        "apply",
        "--simulate",
        "dgx-a100-80gb",
        "--sim-state",
        str(sim),
        "-c",
        "all-1g.10gb",
    ]
    made = _na(short_tmp, "sim", "show", "--simulate", "dgx-a100-80gb", "--sim-state", str(sim))
    assert made.returncode == 0, made.stderr  # the state, made by root
    before = sim.read_bytes()
    r = subprocess.run(
        [
            *NO_DAC,
            sys.executable,
            "-m",
            "nodeagent",
            *args,
        ],
        cwd=short_tmp,
        env=_env(short_tmp),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {state_dir}: Permission denied (nothing more was changed)"], r.stderr
    assert sim.read_bytes() == before  # no MIG change reached the (simulated) GPUs
