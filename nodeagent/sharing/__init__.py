"""Sharing: NVIDIA device-plugin config (v1) and the pure Inventory → resources/devices mapping.

Pure: no I/O, no gRPC, no NVML.
"""
