#!/usr/bin/env bash
# Regenerate the committed protobuf/gRPC modules from the .proto files here (needs grpcio-tools, in .[test]).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
protos=(pluginregistration dra_v1 dra_v1beta1 dra_health)
for p in "${protos[@]}"; do
  "$PY" -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. "$p.proto"
  # grpc_tools writes "import X_pb2"; make it package-relative so the modules import from anywhere.
  sed -i "s/^import ${p}_pb2 as /from . import ${p}_pb2 as /" "${p}_pb2_grpc.py"
done
