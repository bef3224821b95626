#!/usr/bin/env bash
# Regenerate the committed protobuf/gRPC modules from podresources.proto (needs grpcio-tools, in .[test]).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
"$PY" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. podresources.proto
# grpc_tools writes "import podresources_pb2"; make it package-relative.
sed -i 's/^import podresources_pb2 as podresources__pb2$/from . import podresources_pb2 as podresources__pb2/' podresources_pb2_grpc.py
