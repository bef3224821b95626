"""Network facts (NIC speed, RDMA capability) read with pyroute2 for node labels.

Read-only: never changes interfaces.
"""
