"""Runtime: containerd and nvidia-container-runtime configuration, atomic files, restarts.

The render functions are pure; files.py and restart.py are the only side effects.
"""
