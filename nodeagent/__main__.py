"""Entry point for ``python -m nodeagent``."""

from nodeagent.cli import main

if __name__ == "__main__":
    main()
