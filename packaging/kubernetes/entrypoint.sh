#!/bin/sh
# Make the host driver's NVML visible without putting the host's whole library directory (its libc)
# on the search path: link just libnvidia-ml.so.1 into a private directory.
set -e
for dir in /host/usr/lib/x86_64-linux-gnu /host/usr/lib64 /host/run/nvidia/driver/usr/lib/x86_64-linux-gnu; do
  if [ -e "$dir/libnvidia-ml.so.1" ]; then
    mkdir -p /run/nvml
    ln -sf "$dir/libnvidia-ml.so.1" /run/nvml/libnvidia-ml.so.1
    export LD_LIBRARY_PATH="/run/nvml${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    break
  fi
done
exec /opt/nodeagent/bin/nodeagent "$@"
