"""Aggregate raw samples into per-cell statistics and the density recommendation.

A cell is (configuration, density); its samples pool every repeat, iteration and sandbox. Each cell
has statistics over successes and with failures counted at the timeout; the spread of p50/p99
across repeats; throughput; and per-G amplification. The amplification the recommendation uses is
the failures-included one (a failed rollout stalls its group at least as long as the timeout);
`amplification_successes` is given beside it.

Recommendation (per configuration): the highest density such that it and every lower tested
density keep amplification at G within `tolerance` of the lowest density's. It is compared with the
seed's 1.0x rule (p99 flat up to 1.0 sandbox per vCPU, cliff within the next 15%).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import numpy as np

from slipstream.sweep.samples import Sample
from slipstream.sweep.stats import (
    amplification,
    distribution_stats,
    group_stats,
    round_significant,
    spread,
)

SCHEMA_VERSION = 1


def _cell_key(s: Sample) -> tuple[str, float]:
    return (s.config_id, s.density)


def _throughput(samples: list[Sample]) -> float | None:
    """Successful tasks per second of barrier-to-last-finish wall time, summed over iterations."""
    by_iteration: dict[tuple[int, int], list[Sample]] = defaultdict(list)
    for s in samples:
        if math.isfinite(s.t_start_s) and math.isfinite(s.latency_s):
            by_iteration[(s.repeat, s.iteration)].append(s)
    wall_s = 0.0
    for group in by_iteration.values():
        wall_s += max(s.t_start_s + s.latency_s for s in group) - min(s.t_start_s for s in group)
    n_ok = sum(s.ok for s in samples)
    return round_significant(n_ok / wall_s) if wall_s > 0 else None


def aggregate_cell(samples: list[Sample], cfg: dict, seed: int) -> dict:
    first = samples[0]
    timeout_s = float(cfg["timeout_s"])
    group_sizes = [int(g) for g in cfg["group_sizes"]]
    ok_s = np.array([s.latency_s for s in samples if s.ok], dtype=np.float64)
    failures = Counter(s.reason for s in samples if not s.ok)
    num_failures = sum(failures.values())
    all_s = np.concatenate([ok_s, np.full(num_failures, timeout_s)])
    repeats = sorted({s.repeat for s in samples})
    p50s, p99s = [], []
    for r in repeats:
        x = np.array([s.latency_s for s in samples if s.ok and s.repeat == r], dtype=np.float64)
        if x.size:
            p50, p99 = np.percentile(x, [50, 99])
            p50s.append(float(p50))
            p99s.append(float(p99))
    groups = group_stats(all_s, num_failures, group_sizes, int(cfg["bootstrap_resamples"]), seed)
    for g in group_sizes:
        groups[str(g)]["amplification_successes"] = round_significant(amplification(ok_s, g))
    details = sorted({f"{s.reason}: {s.detail}" for s in samples if not s.ok and s.detail})
    return {
        "config_id": first.config_id,
        "backend": first.backend,
        "pinning": first.pinning,
        "memory": first.memory,
        "smt": first.smt,
        "density": first.density,
        "num_sandboxes": first.num_sandboxes,
        "n": len(samples),
        "n_ok": int(ok_s.size),
        "failures": dict(sorted(failures.items())),
        "failure_examples": details[:5],
        "fail_rate": round_significant(num_failures / len(samples)),
        "successes": distribution_stats(ok_s),
        "with_failures_at_timeout": distribution_stats(all_s),
        "repeats": {
            "n": len(repeats),
            "p50_s": [round_significant(v) for v in p50s],
            "p99_s": [round_significant(v) for v in p99s],
            "p50_spread": spread(p50s),
            "p99_spread": spread(p99s),
        },
        "throughput_tasks_per_s": _throughput(samples),
        "groups": groups,
    }


def _verdict(
    rec_eff: float, rule_eff: float | None, cliff_eff: float | None, max_eff: float
) -> tuple:
    """(agrees: bool | None, sentence) comparing a recommendation with the 1.0x rule."""
    if cliff_eff is None and max_eff <= 1.0:
        return None, "cannot tell: no density above 1.0 per vCPU was tested"
    if (rule_eff is not None and math.isclose(rec_eff, rule_eff)) or 1.0 <= rec_eff <= 1.15:
        return True, "agrees with the 1.0x rule"
    if rec_eff < 1.0:
        return False, (
            f"tighter than the 1.0x rule: amplification already grows at {cliff_eff:.3g} per vCPU"
        )
    if cliff_eff is None:
        return (
            False,
            f"looser than the 1.0x rule: no cliff up to {max_eff:.3g} per vCPU (highest tested)",
        )
    return (
        False,
        f"looser than the 1.0x rule: flat up to {rec_eff:.3g}, grows at {cliff_eff:.3g} per vCPU",
    )


def recommend(cells: list[dict], g: int, tolerance: float, num_vcpus: int) -> list[dict]:
    by_config: dict[str, list[dict]] = defaultdict(list)
    for c in cells:
        by_config[c["config_id"]].append(c)
    out = []
    for config_id, cs in by_config.items():
        cs = sorted(cs, key=lambda c: c["density"])
        # A cell without a single success has no meaningful amplification (all at the timeout).
        amps = [c["groups"][str(g)]["amplification"] if c["n_ok"] else None for c in cs]
        base = amps[0]
        entry: dict = {"config_id": config_id, "g": g, "tolerance": tolerance}
        if base is None:
            entry.update(recommended=None, verdict="no successful sample at the lowest density")
            out.append(entry)
            continue
        limit = base * (1.0 + tolerance)
        rec = cs[0]
        cliff = None
        for c, a in zip(cs, amps, strict=True):
            if a is None or a > limit:
                cliff = c
                break
            rec = c
        eff = rec["num_sandboxes"] / num_vcpus
        cliff_eff = cliff["num_sandboxes"] / num_vcpus if cliff else None
        max_eff = cs[-1]["num_sandboxes"] / num_vcpus
        tested_le_1 = [
            c["num_sandboxes"] / num_vcpus for c in cs if c["num_sandboxes"] <= num_vcpus
        ]
        rule_eff = max(tested_le_1) if tested_le_1 else None
        agrees, verdict = _verdict(eff, rule_eff, cliff_eff, max_eff)
        # The crossing is "within noise" when the exceeding cell's CI still reaches the limit.
        ci_lo = cliff["groups"][str(g)]["ci95"][0] if cliff else None
        uncertain = bool(cliff) and (ci_lo is None or ci_lo <= limit)
        entry.update(
            baseline_density=cs[0]["density"],
            baseline_amplification=base,
            limit_amplification=round_significant(limit),
            recommended={
                "density": rec["density"],
                "sandboxes_per_vcpu": round_significant(eff),
                "num_sandboxes": rec["num_sandboxes"],
                "amplification": rec["groups"][str(g)]["amplification"],
            },
            first_exceeding_density=cliff["density"] if cliff else None,
            first_exceeding_amplification=amps[cs.index(cliff)] if cliff else None,
            rule_1x_num_sandboxes=num_vcpus,
            uncertain=uncertain,
            agrees_with_1x_rule=agrees,
            verdict=verdict,
        )
        out.append(entry)
    return out


def aggregate(samples: list[Sample], cfg: dict, num_vcpus: int) -> dict:
    """All cells (in first-seen configuration order, densities ascending) and recommendations."""
    groups: dict[tuple[str, float], list[Sample]] = defaultdict(list)
    config_order: list[str] = []
    for s in samples:
        groups[_cell_key(s)].append(s)
        if s.config_id not in config_order:
            config_order.append(s.config_id)
    keys = sorted(groups, key=lambda k: (config_order.index(k[0]), k[1]))
    cells = [aggregate_cell(groups[k], cfg, seed=int(cfg["seed"]) + i) for i, k in enumerate(keys)]
    return {
        "schema": SCHEMA_VERSION,
        "num_vcpus": num_vcpus,
        "num_samples": len(samples),
        "num_failures": sum(not s.ok for s in samples),
        "cells": cells,
        "recommendations": recommend(
            cells, int(cfg["recommend_g"]), float(cfg["tolerance"]), num_vcpus
        ),
    }
