"""The ledger of the two planes (plane "both") and the planning of a move: which GPUs move, in which order,
which wait for which holders; no GPU is ever offered by both planes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from nodeagent.config import parse_config
from nodeagent.daemon.planes import DRA, PLUGIN, Move, PlaneSplit, check_dra_gpus, only_the_split_changed
from nodeagent.daemon.shared import PlaneLedger
from nodeagent.errors import ConfigError

GPUS = range(8)


def offered(split: PlaneSplit) -> tuple[set[int], set[int]]:
    """(GPUs the device plugin lists, GPUs in the ResourceSlices)."""
    return set(GPUS) - split.plugin_excluded, set(split.dra - split.to_plugin)


def test_a_new_split_withdraws_what_changes_plane_and_moves_the_free_gpus_only() -> None:
    split = PlaneSplit.initial({0, 1})
    assert offered(split) == ({2, 3, 4, 5, 6, 7}, {0, 1})

    moving = split.toward(frozenset({1, 2, 3}), GPUS)  # GPU 0 leaves DRA; GPUs 2 and 3 leave the plugin
    assert moving == PlaneSplit(dra=frozenset({1}), to_dra=frozenset({2, 3}), to_plugin=frozenset({0}))
    assert offered(moving) == ({4, 5, 6, 7}, {1})  # withdrawn from both sides before anything is added
    assert moving.dra_served == {0, 1}  # GPU 0's prepared claims are still answered

    held = {0: ("claim ml/a",), 3: ("ml/p",)}
    moves, after = moving.settle(held)
    assert moves == [Move(2, PLUGIN, DRA)]
    assert offered(after) == ({4, 5, 6, 7}, {1, 2})
    assert after.blocked(held) == {0: Move(0, DRA, PLUGIN), 3: Move(3, PLUGIN, DRA)}
    assert str(after.blocked(held)[0]) == "GPU 0 from DRA to the device plugin"

    moves, done = after.settle({})  # the holders ended: each moves by itself
    assert moves == [Move(0, DRA, PLUGIN), Move(3, PLUGIN, DRA)]
    assert done == PlaneSplit.initial({1, 2, 3}) and not done.moving
    assert offered(done) == ({0, 4, 5, 6, 7}, {1, 2, 3})


def test_a_gpu_on_its_way_sent_back_returns_to_its_holders_plane_at_once() -> None:
    moving = PlaneSplit.initial({0}).toward(frozenset({1}), GPUS)  # 0 to the plugin, 1 to DRA
    back = moving.toward(frozenset({0}), GPUS)
    assert back == PlaneSplit.initial({0})
    assert moving.toward(frozenset({1}), GPUS) == moving  # the same split again changes nothing


def test_no_gpu_is_ever_offered_by_both_planes() -> None:
    split = PlaneSplit.initial({0, 1, 2})
    steps = [frozenset({3, 4}), frozenset({0, 4, 5}), frozenset(GPUS), frozenset({7})]
    for wanted in steps:
        for held in ({}, {g: ("x",) for g in GPUS if g % 2}):
            split = split.toward(wanted, GPUS)
            plugin, dra = offered(split)
            assert not plugin & dra
            _, split = split.settle(held)
            plugin, dra = offered(split)
            assert not plugin & dra
            assert split.wanted_dra == wanted


def test_bad_dra_gpus_is_one_error_naming_the_key_and_what_the_node_has() -> None:
    check_dra_gpus([0, 7], GPUS, "c.toml")
    with pytest.raises(ConfigError) as e:
        check_dra_gpus([1, 9], GPUS, "c.toml")
    assert str(e.value) == ("c.toml: key 'dra.gpus' names GPU 9, which this node does not have "
                            "(GPU indices: 0, 1, 2, 3, 4, 5, 6, 7)")


def test_only_a_change_of_dra_gpus_under_plane_both_is_a_live_move() -> None:
    old = parse_config('[device_plugin]\nplane = "both"\n[dra]\ngpus = [0]\n', "c.toml")
    new = dataclasses.replace(old, dra=dataclasses.replace(old.dra, gpus=(1,)))
    assert only_the_split_changed(old, new, {"dra"})
    assert not only_the_split_changed(old, new, {"dra", "health"})
    other = dataclasses.replace(new, dra=dataclasses.replace(new.dra, verify_interval=7.0))
    assert not only_the_split_changed(old, other, {"dra"})
    dra_only = dataclasses.replace(new, device_plugin=dataclasses.replace(new.device_plugin, plane="dra"))
    assert not only_the_split_changed(old, dra_only, {"dra", "device_plugin"})


def test_the_ledger_file_keeps_a_move_under_way_for_the_next_process(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state/planes.json"
    first = PlaneLedger()
    first.bind(path)
    assert first.split is None and not path.exists()
    moving = PlaneSplit.initial({0, 1}).toward(frozenset({1, 2}), GPUS)
    first.split = moving
    assert path.stat().st_mode & 0o777 == 0o600

    restarted = PlaneLedger()
    restarted.bind(path)
    assert restarted.split == moving
    assert restarted.plugin_excluded((1, 2)) == {0, 1, 2}  # GPU 0 still waits for its holders

    restarted.split = None  # one plane again: nothing to keep
    assert not path.exists()

    path.write_text('{"dra": [0], "to_dra": [0], "to_plugin": []}\n')
    damaged = PlaneLedger()
    damaged.bind(path)
    assert damaged.split is None and damaged.plugin_excluded((3,)) == {3}
    assert f"planes: {path} is damaged (a GPU is in two places)" in caplog.text
