"""Kubernetes: the only layer that imports the kubernetes client; labels, status, events, GPU objects.

It publishes what it is handed; it does not decide what the node should be.
"""
