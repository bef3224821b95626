"""The real parts of the node, one module each; ``nodeagent.daemon.wiring`` builds them from the config."""
