"""nodeagent: one host daemon that makes a Kubernetes GPU node ready and keeps it right.

The package root only carries the version; every layer lives in its own subpackage.
"""

__version__ = "0.1.0"
