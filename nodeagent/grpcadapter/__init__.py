"""The one place nodeagent meets grpcio: Unix-socket channels for its clients (``client``) and the bounded
servers behind the kubelet sockets (``server``); callers never import grpc themselves.

It knows no device, claim or kubelet semantics: callers hand it their servicers and their error types.
"""
