"""nodeagent: one host daemon that makes a Kubernetes GPU node ready and keeps it right.

The package root only carries the version and one setting gRPC reads when it loads; every layer lives in
its own subpackage.
"""

import os

# The DRA driver's gRPC server (grpcio; the device-plugin sockets are served by nodeagent.wire instead)
# answers the kubelet on Unix sockets, one short call at a time. With gRPC's own listener the thread polling
# the completion queue does the socket I/O itself; the EventEngine listener (gRPC's default) hands every
# read and write to its I/O threads, one more thread hop per call (about 50 µs, measured on grpcio's
# threaded server with tests/bench/bench_deviceplugin.py). gRPC reads this once, when it loads, so it is set
# here, before anything imports grpc; an operator's own value is kept.
os.environ.setdefault("GRPC_EXPERIMENTS", "-event_engine_listener")

__version__ = "0.1.0"
