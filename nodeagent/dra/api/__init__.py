"""Kubelet plugin-registration v1, DRA v1/v1beta1 and DRA health v1alpha1: our own .proto files and the
modules generated from them.

Generated code only (regenerate with ``generate.sh``); no logic lives here.
"""

from typing import Any

from . import dra_health_pb2 as _health_pb2
from . import dra_health_pb2_grpc as _health_pb2_grpc
from . import dra_v1_pb2 as _v1_pb2
from . import dra_v1_pb2_grpc as _v1_pb2_grpc
from . import dra_v1beta1_pb2 as _v1beta1_pb2
from . import dra_v1beta1_pb2_grpc as _v1beta1_pb2_grpc
from . import pluginregistration_pb2 as _reg_pb2
from . import pluginregistration_pb2_grpc as _reg_pb2_grpc

# The generated modules build their classes at import time, so type checkers cannot see them.
reg_pb2: Any = _reg_pb2
reg_pb2_grpc: Any = _reg_pb2_grpc
v1_pb2: Any = _v1_pb2
v1_pb2_grpc: Any = _v1_pb2_grpc
v1beta1_pb2: Any = _v1beta1_pb2
v1beta1_pb2_grpc: Any = _v1beta1_pb2_grpc
health_pb2: Any = _health_pb2
health_pb2_grpc: Any = _health_pb2_grpc
