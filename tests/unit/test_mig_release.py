"""The inputs of the no-drain MIG wait: ``mig.release_timeout`` and which pods hold which GPU (pure)."""

from __future__ import annotations

import pytest

from nodeagent.config import parse_config
from nodeagent.errors import ConfigError
from nodeagent.kube.podresources import Assignment, holders_by_gpu


def test_release_timeout_default_zero_and_negative() -> None:
    assert parse_config("", "c.toml").mig.release_timeout == 300.0
    assert parse_config("[mig]\nrelease_timeout = 0\n", "c.toml").mig.release_timeout == 0.0
    with pytest.raises(ConfigError) as e:
        parse_config("[mig]\nrelease_timeout = -1\n", "c.toml")
    assert str(e.value) == "c.toml: key 'mig.release_timeout' must not be negative, got -1.0"
    with pytest.raises(ConfigError, match=r"key 'mig.release_timeout' must be a number, got '5m'$"):
        parse_config('[mig]\nrelease_timeout = "5m"\n', "c.toml")


def test_holders_by_gpu_names_every_pod_once_per_gpu() -> None:
    gpus = {("nvidia.com/gpu", "GPU-a"): 0, ("nvidia.com/gpu", "GPU-a::1"): 0,
            ("nvidia.com/mig-1g.10gb", "MIG-b"): 3}
    assignments = [
        Assignment("ml", "train", "main", "nvidia.com/gpu", ("GPU-a",)),
        Assignment("ml", "train", "side", "nvidia.com/gpu", ("GPU-a::1",)),  # same pod, other container
        Assignment("web", "infer", "c", "nvidia.com/mig-1g.10gb", ("MIG-b", "MIG-c")),
        Assignment("ab", "eval", "c", "nvidia.com/gpu", ("GPU-a",)),
        # same ID under a resource these GPUs do not give: not theirs
        Assignment("x", "other", "c", "example.com/gpu", ("GPU-a",)),
    ]
    assert holders_by_gpu(assignments, gpus) == {0: ("ab/eval", "ml/train"), 3: ("web/infer",)}
    assert holders_by_gpu(assignments, {}) == {}
    assert holders_by_gpu([], gpus) == {}
