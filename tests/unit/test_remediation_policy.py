"""Remediation policy (catalog, recovery action, overrides, quarantine), its config section, and the planner."""

from __future__ import annotations

import pytest

from nodeagent.config import REMEDIATION_ACTIONS, parse_config
from nodeagent.errors import ConfigError
from nodeagent.remediation.planner import GpuFacts, Step, plan, reset_group, resume_from
from nodeagent.remediation.policy import Action, QuarantineLedger, decide, load_catalog, parse_catalog


@pytest.fixture(scope="module")
def catalog():  # type: ignore[no-untyped-def]
    return load_catalog()


def test_catalog_names_its_source_and_follows_nvidia_immediate_actions(catalog) -> None:  # type: ignore[no-untyped-def]
    assert "Xid-Catalog.xlsx" in catalog.source and "NVSentinel" in catalog.source
    expected = {13: Action.RESTART_APP, 31: Action.RESTART_APP, 43: Action.NONE, 48: Action.RESET_GPU,
                63: Action.NONE, 64: Action.RESET_GPU, 79: Action.REBOOT_NODE, 94: Action.RESTART_APP,
                95: Action.RESET_GPU, 109: Action.RESET_GPU, 119: Action.RESET_GPU, 120: Action.RESET_GPU,
                140: Action.RESET_GPU}
    for xid, action in expected.items():
        assert decide(xid, 0, catalog).action is action, xid
    assert catalog.get(48).immediate == "WORKFLOW_XID_48"
    assert catalog.get(154).action is None  # follow the driver


def test_recovery_action_wins_over_the_catalog_and_overrides_win_over_both(catalog) -> None:  # type: ignore[no-untyped-def]
    assert decide(13, 1, catalog).action is Action.RESET_GPU  # the driver asks for a reset
    assert decide(154, 4, catalog).action is Action.DRAIN_AND_RESET
    assert decide(154, 2, catalog).action is Action.REBOOT_NODE
    assert decide(None, 5, catalog).action is Action.RECOVER_IMEX
    assert decide(154, 0, catalog).action is Action.NONE
    assert decide(None, 0, catalog).action is Action.NONE
    assert decide(999, 0, catalog).action is Action.NONE
    d = decide(48, 2, catalog, {48: Action.RESET_GPU})
    assert d.action is Action.RESET_GPU and "configured" in d.why


def test_xid_48_after_a_row_remap_failure_drains_first(catalog) -> None:  # type: ignore[no-untyped-def]
    assert decide(48, 0, catalog, recent_xids=(63,)).action is Action.DRAIN_AND_RESET
    assert decide(48, 0, catalog, recent_xids=(64,)).action is Action.DRAIN_AND_RESET
    assert decide(48, 0, catalog, recent_xids=(13,)).action is Action.RESET_GPU


def test_a_malformed_catalog_is_refused_naming_the_entry() -> None:
    with pytest.raises(ConfigError, match=r"xids\.48\.action: unknown action 'explode'"):
        parse_catalog({"source": "x", "xids": {"48": {"action": "explode"}}})
    with pytest.raises(ConfigError, match="name its source"):
        parse_catalog({"xids": {}})


def test_quarantine_after_n_resets_in_the_window() -> None:
    led = QuarantineLedger(max_resets=2, window_s=100.0)
    led.record("GPU-a", 0.0)
    assert not led.quarantined("GPU-a", 1.0)
    led.record("GPU-a", 50.0)
    assert led.quarantined("GPU-a", 60.0)
    assert not led.quarantined("GPU-a", 120.0)  # the first reset left the window
    assert not led.quarantined("GPU-b", 60.0)
    carried = QuarantineLedger(2, 100.0, {"GPU-a": [10.0, 20.0]})
    assert carried.quarantined("GPU-a", 30.0)
    assert not QuarantineLedger(0, 100.0, {"GPU-a": [10.0, 20.0]}).quarantined("GPU-a", 30.0)  # 0: never


def test_config_section_parses_and_each_bad_key_is_named() -> None:
    cfg = parse_config('[remediation]\nenabled = true\nmax_resets = 2\ncordon_on_failure = true\n'
                       '[remediation.xid_actions]\n"48" = "drain-and-reset"\n"13" = "none"\n', "agent.toml")
    assert cfg.remediation.enabled and cfg.remediation.max_resets == 2
    assert cfg.remediation.xid_actions == {"48": "drain-and-reset", "13": "none"}
    assert not parse_config("", "agent.toml").remediation.enabled  # off by default
    assert set(REMEDIATION_ACTIONS) == {a.value for a in Action}
    bad = {
        '[remediation.xid_actions]\n"48" = "explode"\n': "remediation.xid_actions.48' must be one of",
        '[remediation.xid_actions]\nabc = "none"\n': "remediation.xid_actions.abc' is not an XID number",
        '[remediation.xid_actions]\n"48" = 1\n': "remediation.xid_actions' must be a table of strings",
        '[remediation]\neviction_grace = -1\n': "remediation.eviction_grace' must be greater than 0",
        '[remediation]\nmax_resets = -1\n': "remediation.max_resets' must not be negative",
        '[remediation]\nreboot = true\n': "unknown key 'remediation.reboot'",
    }
    for text, message in bad.items():
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
            parse_config(text, "agent.toml")


def _ring(arch: str) -> dict[str, GpuFacts]:
    """Four GPUs all NVLinked, plus one without NVLink."""
    ids = [f"GPU-{i}" for i in range(4)]
    out = {u: GpuFacts(i, u, arch, nvlink_peers=tuple(p for p in ids if p != u)) for i, u in enumerate(ids)}
    out["GPU-4"] = GpuFacts(4, "GPU-4", arch)
    return out


def test_nvlink_peers_are_reset_together_only_where_nvidia_says_so() -> None:
    ampere, hopper = _ring("ampere"), _ring("hopper")
    assert reset_group(ampere["GPU-2"], ampere, fabric_manager=False) == ("GPU-2", "GPU-0", "GPU-1", "GPU-3")
    assert reset_group(ampere["GPU-2"], ampere, fabric_manager=True) == ("GPU-2",)
    assert reset_group(hopper["GPU-2"], hopper, fabric_manager=False) == ("GPU-2",)
    assert reset_group(ampere["GPU-4"], ampere, fabric_manager=False) == ("GPU-4",)
    volta = _ring("volta")
    assert len(reset_group(volta["GPU-0"], volta, fabric_manager=True)) == 4


def test_plans_name_only_the_pods_of_the_gpus_reset(catalog) -> None:  # type: ignore[no-untyped-def]
    gpus = _ring("hopper")
    holders = {"GPU-0": ["a/p0"], "GPU-1": ["b/p1", "b/mig-on-1"], "GPU-4": ["c/p4"]}
    p = plan(decide(48, 0, catalog), gpus["GPU-1"], gpus, holders)
    assert p.pods == ("b/mig-on-1", "b/p1") and p.gpus == ("GPU-1",)
    assert p.steps == (Step.WITHDRAW, Step.EVICT, Step.STOP_USERS, Step.PERSISTENCE_OFF, Step.RESET,
                       Step.VERIFY, Step.RESTORE, Step.OFFER)
    drained = plan(decide(48, 0, catalog, recent_xids=(64,)), gpus["GPU-1"], gpus, holders)
    assert Step.DRAIN in drained.steps and drained.steps.index(Step.DRAIN) < drained.steps.index(Step.RESET)
    together = plan(decide(48, 0, catalog), _ring("ampere")["GPU-1"], _ring("ampere"), holders,
                    fabric_manager=False)
    assert together.pods == ("a/p0", "b/mig-on-1", "b/p1")  # peers' pods too; never GPU-4's
    app = plan(decide(13, 0, catalog), gpus["GPU-4"], gpus, holders)
    assert app.steps == (Step.NOTIFY,) and app.pods == ("c/p4",)
    assert plan(decide(79, 0, catalog), gpus["GPU-0"], gpus, holders).steps == (Step.WITHDRAW, Step.REBOOT_REQUIRED)
    assert plan(decide(43, 0, catalog), gpus["GPU-0"], gpus, holders).steps == ()
    assert plan(decide(None, 5, catalog), gpus["GPU-0"], gpus, holders).steps == (Step.IMEX_RECOVERY,)
    q = plan(decide(48, 0, catalog), gpus["GPU-1"], gpus, holders, quarantined=True)
    assert q.steps == (Step.WITHDRAW, Step.QUARANTINE) and q.pods == ()


def test_a_successor_repeats_the_step_that_was_running() -> None:
    steps = (Step.WITHDRAW, Step.EVICT, Step.RESET, Step.VERIFY)
    assert resume_from(steps, (Step.WITHDRAW,)) == (Step.EVICT, Step.RESET, Step.VERIFY)
    assert resume_from(steps, steps) == ()
