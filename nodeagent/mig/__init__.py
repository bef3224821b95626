"""MIG: mig-parted config spec, a pure placement planner, apply with rollback, label reconciler.

Only the apply adapter changes GPUs, and only through the gpu layer's NVML adapter.
"""
