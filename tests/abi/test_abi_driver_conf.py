"""The stand-in installed as a host's driver library: with no NODEAGENT_SIM_* in the environment (a container
that inherits none of the host's), it reads its machine and state from ``nodeagent-sim.conf`` beside it,
a relative state path taken from the library's own directory (as tests/peers/cluster.py installs it)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tests.abi._abi import built, library, run


def _env(libdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NODEAGENT_SIM_") and k != "NODEAGENT_NVML_STATE"}
    env["LD_LIBRARY_PATH"] = str(libdir)
    return env


def test_conf_beside_the_library_names_machine_and_relative_state(tmp_path: Path) -> None:
    libdir = tmp_path / "host" / "usr" / "lib"
    libdir.mkdir(parents=True)
    shutil.copy(library(), libdir / "libnvidia-ml.so.1")
    (tmp_path / "host" / "var" / "sim").mkdir(parents=True)
    (libdir / "nodeagent-sim.conf").write_text("# test\nmachine = dgx-a100-80gb\nstate = ../../var/sim/state.json\n")
    proc = run([str(built("NODEAGENT_NVML_VIEW"))], _env(libdir))
    view = json.loads(proc.stdout)
    assert len(view["gpus"]) == 8, view
    assert all("A100" in g["name"] for g in view["gpus"]), view
    # the state file is where the relative path points from the library's directory
    assert (tmp_path / "host" / "var" / "sim" / "state.json").is_file()


def test_bad_line_is_one_message_and_no_machine(tmp_path: Path) -> None:
    shutil.copy(library(), tmp_path / "libnvidia-ml.so.1")
    (tmp_path / "nodeagent-sim.conf").write_text("machine: dgx-h100\n")
    proc = run([str(built("NODEAGENT_NVML_VIEW"))], _env(tmp_path), check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "nodeagent-sim.conf" in line]
    assert len(lines) == 1 and "cannot read the line 'machine: dgx-h100'" in lines[0], proc.stderr
