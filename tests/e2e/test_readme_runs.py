"""Every command in the README runs as printed, in order, from a fresh directory (relative paths and all).

Each shell line of the README's ``sh`` blocks is either run here (the ``nodeagent`` commands; a ``run`` is
started, awaited until it serves, and stopped with Ctrl-C) or named below with the test that runs it."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# README lines that run elsewhere: (start of the line, the test that runs it)
ELSEWHERE = {
    "python3 -m venv .venv && .venv/bin/pip install": "tests/e2e/test_readme_quickstart.py (the agent it starts)",
    ". .venv/bin/activate": "a shell built-in; the commands after it run here as `nodeagent`",
    "bash tests/run.sh": "this suite itself (.ci/run)",
    "bash packaging/build-deb.sh": "tests/e2e/test_delivery.py (the .deb, built in a fresh clone), "
                                   "tests/e2e/test_distros_chroot.py (--arch amd64 and arm64)",
    "apt-get install ./dist/nodeagent_": "tests/e2e/test_systemd_boot.py, test_distros.py and test_distros_chroot.py (Debian 12 and 13 roots)",
    "kubectl apply -f packaging/kubernetes/": "tests/e2e/test_kube_manifests.py (server-side dry run)",
    "kubectl label node": "tests/e2e/test_kube_manifests.py",
    "buildah build -f packaging/kubernetes/Containerfile": "tests/testbin/setup.sh (nodeagent_peers_agent_image: the "
                                                          "same build from local base images and a wheelhouse)",
    "buildah push registry.example.com/": "tests/e2e/test_image_push.py (into a registry on 127.0.0.1)",
    "buildah build --platform linux/amd64,linux/arm64 --manifest": "tests/testbin/setup.sh (each platform's image "
                                                                   "and the index of both)",
    "buildah manifest push --all": "tests/cluster/test_whole_node.py (into a registry on 127.0.0.1 that the "
                                   "cluster's containerd pulls the agent from)",
    "kubectl set image -n nodeagent daemonset/nodeagent": "tests/cluster/test_whole_node.py, test_handover.py",
    "kubectl create namespace nodeagent": "tests/cluster/test_whole_node.py (the README's Helm lines)",
    "kubectl label namespace nodeagent": "tests/cluster/test_whole_node.py (the README's Helm lines)",
    "helm install nodeagent packaging/helm/nodeagent": "tests/cluster/test_whole_node.py (on the whole-node "
                                                       "cluster), tests/e2e/test_helm_chart.py (a real apiserver)",
}
# commands whose exit code says what they found: 1 = warnings (a sandbox has no kubelet) is fine
FINDING_EXIT = {"doctor": (0, 1)}


def readme_lines() -> list[str]:
    text = (REPO / "README.md").read_text()
    lines: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                lines.append(line)
    return lines


@pytest.fixture
def fresh_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="na-rd-", dir="/tmp") as d:  # short: sockets live below it
        yield Path(d)


def _run_agent(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    root = cwd / args[args.index("--root") + 1]
    sock = root / "var/lib/kubelet/device-plugins/nvidia-gpu.sock"
    log = cwd / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nodeagent", *args], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return log.read_text()


def test_every_readme_command_runs_as_printed(fresh_dir: Path) -> None:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("NODEAGENT_", "KUBERNETES_", "KUBECONFIG"))
    }
    env.update(HOME=str(fresh_dir / "home"), XDG_RUNTIME_DIR=str(fresh_dir / "xdg"), PYTHONPATH=str(REPO))
    ran = 0
    for line in readme_lines():
        if any(line.startswith(prefix) for prefix in ELSEWHERE):
            continue
        args = shlex.split(line)
        assert args[0] == "nodeagent", f"a README line neither run here nor named in ELSEWHERE: {line!r}"
        args = args[1:]
        if "run" in args and "--root" in args:
            text = _run_agent(args, fresh_dir, env)
        else:
            r = subprocess.run(
                [sys.executable, "-m", "nodeagent", *args],
                cwd=fresh_dir,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            verb = next(a for a in args if not a.startswith("-") and a not in ("./demo",))
            assert r.returncode in FINDING_EXIT.get(verb, (0,)), (line, r.stdout[-2000:], r.stderr[-2000:])
            text = r.stdout + r.stderr
        assert "Traceback" not in text and "error:" not in text, (line, text[-3000:])
        ran += 1
    assert ran >= 6, ran


def test_the_elsewhere_list_names_only_readme_lines() -> None:
    lines = readme_lines()
    for prefix in ELSEWHERE:
        assert any(line.startswith(prefix) for line in lines), (
            f"ELSEWHERE names a line the README lost: {prefix}"
        )


def test_the_run_the_agent_line_runs_in_a_fresh_directory(fresh_dir: Path) -> None:
    """The "Run the agent" section's command on its own, in a directory where nothing ran before it (its
    ``--root`` and the directory of its ``--sim-state`` made by the agent)."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Run the agent\n", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```sh\n(.*?)```", section, re.S)[0]
    lines = [ln.strip() for ln in block.replace("\\\n", " ").splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("nodeagent "), lines
    args = shlex.split(lines[0])[1:]
    assert "--sim-state" in args and "run" in args, args
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NODEAGENT_", "KUBERNETES_", "KUBECONFIG"))}
    env.update(HOME=str(fresh_dir / "home"), XDG_RUNTIME_DIR=str(fresh_dir / "xdg"), PYTHONPATH=str(REPO))
    assert not any(fresh_dir.iterdir())
    out = _run_agent(args, fresh_dir, env)
    assert "Traceback" not in out and "error:" not in out, out[-3000:]
    assert (fresh_dir / args[args.index("--sim-state") + 1]).is_file()  # the simulator's state, kept
