#!/bin/sh
# Make the host driver's NVML visible without putting the host's whole library directory (its libc)
# on the search path: link just libnvidia-ml.so.1 (and libcuda.so.1, which the MPS server the agent's control
# daemons start needs; they inherit LD_LIBRARY_PATH) into a private directory. The multiarch directory of
# this machine's own architecture: x86_64-linux-gnu, or aarch64-linux-gnu on Grace nodes.
set -e
triplet="$(uname -m)-linux-gnu"
for dir in "/host/usr/lib/$triplet" /host/usr/lib64 "/host/run/nvidia/driver/usr/lib/$triplet"; do
  if [ -e "$dir/libnvidia-ml.so.1" ]; then
    mkdir -p /run/nvml
    ln -sf "$dir/libnvidia-ml.so.1" /run/nvml/libnvidia-ml.so.1
    if [ -e "$dir/libcuda.so.1" ]; then ln -sf "$dir/libcuda.so.1" /run/nvml/libcuda.so.1; fi
    export LD_LIBRARY_PATH="/run/nvml${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    break
  fi
done
exec /opt/nodeagent/bin/nodeagent "$@"
