"""The CRI messages nodeagent reads (generated from cri.proto by generate.sh)."""
