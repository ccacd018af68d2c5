"""Benchmarks. Each module exposes `register(subparsers)` adding one `slipstream bench <name>`
subcommand; each prints its figure next to its baseline and its limit, measured in the same run,
and writes JSON with provenance under benchmarks/results/."""
