"""Density sweep (`slipstream sweep`, seed 002's labsweep): tail latency vs sandboxes per vCPU.

Modules: plan (matrix x densities, what the host cannot honour), workloads (built-in workloads),
runner (barrier-released sampling through the sandbox layer, noise check), run (orchestration,
provenance, run directory), samples (raw CSV), stats (percentiles, GRPO amplification, bootstrap),
aggregate (per-cell statistics, recommendation), report (aggregates.json, report.md, compare),
plots (PNG). See docs/sweep.md.
"""
