"""Per-GPU remediation: a faulty GPU is withdrawn, emptied of its own pods, reset and offered again while
the node's other GPUs keep running (docs/remediation.md).

``policy``: which action a fault needs (driver's recovery action, NVIDIA's XID catalog, overrides) and the
quarantine ledger; ``planner``: the steps for one GPU (pure); ``pipeline``: runs them, each bounded in
time, reporting through its ports; ``record``: the state record a successor agent resumes from;
``gate``: the hook for a wider disruption budget; ``kubeside``/``commands``: the adapters.
"""
