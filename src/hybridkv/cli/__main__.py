"""``python -m hybridkv.cli``: the `hybridkv` command."""

from hybridkv.cli.root import main

main()
