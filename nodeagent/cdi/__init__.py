"""The node's CDI spec (Container Device Interface): ``/var/run/cdi/nvidia.yaml`` kept in step with the GPUs.

``names`` is how devices are named (shared with the device plugin), ``host`` reads the facts the spec
needs from the host (``/proc`` MIG capability minors, ``/dev`` nodes, the driver's files), ``spec``
turns an inventory plus those facts into the spec (pure), ``writer`` writes it atomically when it
changed, and ``simhost`` lays out the same host facts for a simulated machine.
"""

from __future__ import annotations

from nodeagent.cdi.names import CDI_KIND, qualified_name

__all__ = ["CDI_KIND", "qualified_name"]
