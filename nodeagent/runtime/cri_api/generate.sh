#!/usr/bin/env bash
# Regenerate the committed protobuf module from cri.proto (needs grpcio-tools, in .[test]). Messages only: the
# one method is called by its path through nodeagent.grpcadapter.client.raw_method.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
"$PY" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. cri.proto
