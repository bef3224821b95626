"""Kubelet device-plugin API v1beta1: our own api.proto and the modules generated from it.

Generated code only (regenerate with ``generate.sh``); no logic lives here.
"""

from typing import Any

from . import api_pb2 as _api_pb2
from . import api_pb2_grpc as _api_pb2_grpc

# The generated modules build their classes at import time, so type checkers cannot see them.
pb2: Any = _api_pb2
pb2_grpc: Any = _api_pb2_grpc
