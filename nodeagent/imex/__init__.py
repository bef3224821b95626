"""IMEX on the node: channel devices and the host-managed ``nvidia-imex`` daemon.

``channels``: ``/dev/nvidia-caps-imex-channels/channel<N>`` made as nvidia-modprobe makes them, and their
CDI entries. ``daemonconfig``: the daemon's config keys and nodes file (pure). ``supervisor``: runs the
daemon, rewrites its nodes file on membership changes and reports its readiness. The clique the daemon's
peers share comes from the GPUs' fabric info (``nodeagent.gpu.fabric``).
"""
