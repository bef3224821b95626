#!/usr/bin/env bash
# Regenerate the committed protobuf/gRPC modules from api.proto (needs grpcio-tools, in .[test]).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
"$PY" -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. api.proto
# grpc_tools writes "import api_pb2"; make it package-relative so the modules import from anywhere.
sed -i 's/^import api_pb2 as api__pb2$/from . import api_pb2 as api__pb2/' api_pb2_grpc.py
