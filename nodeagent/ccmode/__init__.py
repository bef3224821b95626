"""The confidential-computing mode of Hopper/Blackwell GPUs, driven by ``nvidia.com/cc.mode``."""
