"""`hybridkv` command line (the console script is `hybridkv.cli:main`)."""

from hybridkv.cli.root import app, main

__all__ = ["app", "main"]
