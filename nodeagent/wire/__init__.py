"""Wire protocols the daemon speaks itself."""
