"""GPU layer, the production path: the Inventory model, the NVML adapter, topology, MIG profiles and health.

NVML is called only by the adapter (``gpu/nvml.py`` and its ``nvml_*.py`` parts), on the module it is
handed: the real ``pynvml``, or, for ``--simulate``, the simulator or pynvml bound to the stand-in library
(both in ``nodeagent/simulator/``, chosen by ``nodeagent/nvmlsource.py``; nothing here imports them).
Nothing here talks to Kubernetes.
"""
