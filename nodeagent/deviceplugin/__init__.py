"""Device plugin: kubelet v1beta1 gRPC servers, registration, allocation and health streaming.

Never touches NVML directly; it is handed Inventories and health changes.
"""
