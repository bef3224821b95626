"""GPU layer: the Inventory model, the NVML adapter, the simulator, topology and health.

Only ``gpu/nvml.py`` (and the simulator it may be handed) touches NVML; nothing here talks to Kubernetes.
"""
