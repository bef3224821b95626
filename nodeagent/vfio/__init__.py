"""GPUs for virtual machines: the workload config ``nvidia.com/gpu.workload.config`` (container ↔
vm-passthrough), the sysfs binding to vfio-pci and the resources the device plugin serves for them."""
