"""nodeagent's own discover, MIG, metrics, health and device-plugin tests, run again in ABI mode: every
``open_nvml(--simulate/--sim-state)`` in them gets the REAL pynvml bound to the stand-in library, so the
adapter, the MIG applier, the health monitor (XID events through nvmlEventSetWait_v2) and the device plugin
(at the real kubelet device manager) run the production NVML path. An init log proves the C library
served each run. (tests/unit/test_discover_cli.py is not among them: it clears every NODEAGENT_* variable
for its child processes; test_abi_discover.py runs ``nodeagent discover`` in ABI mode instead.)

Deselected, each for a named reason (they reach past NVML, which a real driver does not allow):
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.abi._abi import library

# test id -> why it cannot run on the NVML C ABI
DESELECTED = {
    "tests/unit/test_mig_cli.py::test_busy_refusal_exit_1_and_reboot_exit_3": (
        "expects the simulator's process NAME ('trainer'); NVML's nvmlProcessInfo_t has no name, so on the "
        "real pynvml nodeagent reads /proc/<pid>/comm, which a made-up pid lacks; and it fails simResetGpu "
        "with RESET_REQUIRED, which the nvidia-smi reset path cannot report as an NVML code"
    ),
    "tests/unit/test_mig_cli.py::test_apply_on_a_simulated_machine_without_its_state_file_says_it_is_not_kept": (
        "opens another machine (a30x4) in a process whose stand-in library already holds an earlier test's "
        "machine and state file: the library, loaded once, serves one machine per process as a host has one"
    ),
    "tests/unit/test_mig_cli.py::test_the_default_sandbox_keeps_the_simulated_machine_between_commands": (
        "the same: another machine and a sandbox state file in a process whose library holds another's"
    ),
    "tests/unit/test_health_reload.py::test_simulated_xid_injected_during_replacement_marks_the_gpu": (
        "injects through adapter.nvml.store, the simulator object, which the real pynvml module has not"
    ),
    "tests/unit/test_health_reload.py::test_unhealthy_gpu_stays_unhealthy_when_the_adapter_is_reopened": (
        "injects through adapter.nvml.store"
    ),
    "tests/unit/test_health_reload.py::"
    "test_xid_taken_by_the_closed_adapters_last_wait_reaches_the_new_adapters_monitor": (
        "injects through adapter.nvml.store"
    ),
}
__doc__ = (__doc__ or "") + "".join(f"\n- {k}: {v}" for k, v in DESELECTED.items())

SUITES = {
    "mig": ["tests/unit/test_mig_cli.py", "tests/unit/test_mig_recover_cli.py"],
    "metrics-and-health": ["tests/unit/test_metrics.py", "tests/unit/test_health_reload.py",
                           "tests/e2e/test_dcgm_dashboard.py"],
    "device-plugin-at-the-kubelet": ["tests/integration/test_deviceplugin_kubelet.py"],
    # `nodeagent run` against the real kube-apiserver: nvidia.com/mig.config label -> MIG applied -> success
    "mig-label-flow": ["tests/e2e/test_run_cluster.py::test_labels_mig_change_to_success_and_labels_survive_stop"],
}


@pytest.mark.slow
@pytest.mark.parametrize("suite", list(SUITES))
def test_suite_passes_on_the_real_pynvml_over_the_stand_in(tmp_path: Path, suite: str) -> None:
    init_log = tmp_path / "nvml-inits.log"
    env = dict(os.environ)
    env.update(
        NODEAGENT_SIM_ABI="1",
        NODEAGENT_NVML_LIBRARY=str(library()),
        NODEAGENT_NVML_INIT_LOG=str(init_log),
    )
    files = SUITES[suite]
    deselect = [a for k in DESELECTED if k.split("::")[0] in files for a in ("--deselect", k)]  # whole files only
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs", *files, *deselect],
        cwd=root, env=env, capture_output=True, text=True, timeout=1500, check=False,
    )  # fmt: skip
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary
    inits = init_log.read_text().splitlines() if init_log.exists() else []
    assert inits, f"no process of the {suite} suite initialised NVML through the stand-in library"
