"""``python -m hybridkv``: the `hybridkv` command (the CLI's one entry point besides the
console script)."""

from hybridkv.cli.root import main

main()
