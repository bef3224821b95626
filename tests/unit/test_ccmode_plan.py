"""The pure parts of the CC-mode switch: label values and state labels, the mode NVML's answers mean,
the CPU TEE check and the refusals, the rounds of tool calls."""

from __future__ import annotations

import pytest

from nodeagent.ccmode.plan import (
    CC_READY_LABEL,
    CC_STATE_LABEL,
    CcReading,
    ToolStep,
    parse_mode,
    refusal,
    restore_steps,
    state_labels,
    steps,
    tee_of,
)
from nodeagent.errors import ConfigError

TDX = "/sys/module/kvm_intel/parameters/tdx"
SNP = "/sys/module/kvm_amd/parameters/sev_snp"


def test_label_values_and_states() -> None:
    assert [parse_mode(m) for m in ("on", "off", "devtools", "ppcie")] == ["on", "off", "devtools", "ppcie"]
    with pytest.raises(ConfigError, match=r"nvidia.com/cc.mode has the value 'On': use one of on, off"):
        parse_mode("On")
    assert state_labels("on") == {CC_STATE_LABEL: "on", CC_READY_LABEL: "true"}
    assert state_labels("ppcie") == {CC_STATE_LABEL: "ppcie", CC_READY_LABEL: "true"}
    assert state_labels("off") == {CC_STATE_LABEL: "off", CC_READY_LABEL: "false"}
    assert state_labels("devtools") == {CC_STATE_LABEL: "devtools", CC_READY_LABEL: ""}
    assert state_labels(None) == {CC_STATE_LABEL: "failed", CC_READY_LABEL: ""}


@pytest.mark.parametrize(("feature", "devtools", "multi", "mode"), [
    (0, 0, 0, "off"), (1, 0, 0, "on"), (1, 1, 0, "devtools"), (0, 0, 1, "ppcie")])
def test_mode_from_nvml(feature: int, devtools: int, multi: int, mode: str) -> None:
    assert CcReading(2, feature, devtools, multi, 2, True).mode == mode


def test_tee_like_cc_manager() -> None:
    assert tee_of({TDX: "Y\n", SNP: None}) == "Intel TDX"
    assert tee_of({TDX: "N\n", SNP: "1\n"}) == "AMD SEV-SNP"
    assert tee_of({TDX: "N\n", SNP: "0\n"}) is None
    assert tee_of({}) is None


def test_refusals() -> None:
    why = refusal("on", None, [])
    assert why is not None and "\n" not in why
    assert why.startswith("nvidia.com/cc.mode=on refused: the CPU has no TEE enabled")
    assert refusal("devtools", None, []) is not None
    assert refusal("off", None, ["0"]) is None  # off always applies
    assert "GPU(s) 0, 1 are not capable" in str(refusal("on", "Intel TDX", ["0", "1"]))
    assert refusal("on", "Intel TDX", []) is None


def test_rounds() -> None:
    b = ["0000:18:00.0", "0000:2a:00.0"]
    assert steps("off", "off", b) == []
    assert steps("off", "on", b) == [[ToolStep(b[0], "cc", "on"), ToolStep(b[1], "cc", "on")]]
    assert [[s.argv() for s in r] for r in steps("on", "ppcie", b[:1])] == [
        [["--set-cc-mode=off", "--gpu-bdf=0000:18:00.0"]], [["--set-ppcie-mode=on", "--gpu-bdf=0000:18:00.0"]]]
    assert steps("ppcie", "devtools", b[:1]) == [[ToolStep(b[0], "ppcie", "off")], [ToolStep(b[0], "cc", "devtools")]]
    assert steps("ppcie", "off", b[:1]) == [[ToolStep(b[0], "ppcie", "off")]]
    # putting a failed switch back writes both settings, whatever was left pending
    assert restore_steps("off", b[:1]) == [[ToolStep(b[0], "ppcie", "off")], [ToolStep(b[0], "cc", "off")]]
    assert restore_steps("ppcie", b[:1]) == [[ToolStep(b[0], "cc", "off")], [ToolStep(b[0], "ppcie", "on")]]
