"""nodeagent as a Kubernetes DRA driver (``gpu.nodeagent.io``), beside the device plugin.

- ``devices``: the node's DRA devices (whole GPUs, existing MIG devices) from the ``Inventory`` (pure);
- ``slices``: ResourceSlice bodies for the node's pool (pure) and ``publisher``: writes them on change;
- ``cdi``: the per-claim CDI spec files under ``/var/run/cdi``;
- ``checkpoint``: prepared claims, persisted atomically under ``/var/lib/nodeagent``;
- ``service``: NodePrepareResources / NodeUnprepareResources logic; ``health``: device health feed;
- ``server``: the kubelet-facing gRPC sockets (registration, DRA v1/v1beta1, health v1alpha1);
- ``component``: ``DraComponent``, the piece the daemon starts, feeds and stops.
"""

from __future__ import annotations

DRIVER_NAME = "gpu.nodeagent.io"
