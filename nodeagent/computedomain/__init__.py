"""ComputeDomains (NVIDIA's resource.nvidia.com/v1beta1 CRD): the controller's planner, its Lease and its loop."""
