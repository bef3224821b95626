"""nodeagent's NVML simulator and the NVML ABI stand-in, behind ``--simulate``: not the production path.

- ``machine.py``/``machines/*.yaml``: the simulated machines; ``state.py``: their shared, locked state;
  ``nvml*.py``: the module that answers pynvml's functions from it (``open.open_sim``); ``inject.py``: faults;
  ``watch.py``: the event wait; ``reset.py``: GPU reset the simulator's way.
- ``abi/``: a ``libnvidia-ml.so.1`` that speaks NVML's C ABI and answers from the same state.

The package imports nothing itself, so ``python -m nodeagent.simulator.abi.build`` runs on a bare
interpreter (the test peers' setup builds the stand-in before any dependency is installed).
"""
