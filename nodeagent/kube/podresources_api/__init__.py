"""Kubelet PodResources API v1: our own podresources.proto and the modules generated from it.

Generated code only (regenerate with ``generate.sh``); no logic lives here.
"""
