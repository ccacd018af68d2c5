"""Run directory outputs: aggregates.json, plots and report.md, rebuilt from samples.csv.

`build_outputs(run_dir)` reads samples.csv and provenance.json (the config, plan and host facts
written at run time) and writes everything else; a run calls it too, so `slipstream sweep report
DIR` reproduces aggregates.json and report.md byte for byte. `compare_runs(a, b)` renders two
runs side by side (cells matched by configuration and density).
"""

from __future__ import annotations

import json
from pathlib import Path

from slipstream.sweep.aggregate import aggregate
from slipstream.sweep.plots import PLOT_FILES, write_plots
from slipstream.sweep.samples import read_samples

SAMPLES = "samples.csv"
AGGREGATES = "aggregates.json"
PROVENANCE = "provenance.json"
REPORT = "report.md"


def _f(v, fmt: str = ".4g") -> str:
    return "-" if v is None else format(v, fmt)


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _load_range(loads: list | None) -> str:
    values = [v for v in loads or [] if v is not None]
    return f"{min(values):.2f}-{max(values):.2f}" if values else "-"


def _gib(v) -> str:
    return "-" if v is None else f"{v / 2**30:.1f}"


def load_provenance(run_dir: Path) -> dict:
    path = run_dir / PROVENANCE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: not a sweep run directory")
    return json.loads(path.read_text())


def build_outputs(run_dir: str | Path, plots: bool = True) -> dict:
    """(Re)compute aggregates.json, the plots and report.md from samples.csv + provenance.json.

    `plots=False` skips drawing (the report still links the plot files)."""
    run_dir = Path(run_dir)
    prov = load_provenance(run_dir)
    samples = read_samples(run_dir / SAMPLES)
    if not samples:
        raise ValueError(f"{run_dir / SAMPLES} has no samples")
    sweep = prov["sweep"]
    agg = aggregate(samples, sweep["config"], int(sweep["plan"]["num_vcpus"]))
    (run_dir / AGGREGATES).write_text(json.dumps(agg, indent=1, sort_keys=True) + "\n")
    if plots:
        write_plots(agg, run_dir)
    (run_dir / REPORT).write_text(render_report(agg, prov, list(PLOT_FILES.values())))
    return agg


def _cell_rows(cells: list[dict], group_sizes: list[str]) -> list[str]:
    head = (
        "| density | sandboxes | n | failures | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | CV "
        "| p99/p50 | p50 spread | p99 spread | tasks/s | "
        + " | ".join(f"amp G={g} [95% CI]" for g in group_sizes)
        + " |"
    )
    rows = [head, "|" + "---|" * (14 + len(group_sizes))]
    for c in cells:
        s = c["successes"]
        fails = ", ".join(f"{k} {v}" for k, v in c["failures"].items()) or "0"
        amps = []
        for g in group_sizes:
            gr = c["groups"][g]
            warn = "*" if gr["warning"] else ""
            amps.append(
                f"{_f(gr['amplification'], '.3f')}{warn} [{_f(gr['ci95'][0], '.3f')}, "
                f"{_f(gr['ci95'][1], '.3f')}]"
            )
        rows.append(
            f"| {c['density']:g} | {c['num_sandboxes']} | {c['n']} | {fails} | {_ms(s['p50'])} "
            f"| {_ms(s['p90'])} | {_ms(s['p99'])} | {_ms(s['p99_9'])} | {_ms(s['max'])} "
            f"| {_f(s['cv'], '.3f')} | {_f(s['p99_p50'], '.3f')} "
            f"| {_f(c['repeats']['p50_spread']['rel_range'], '.1%')} "
            f"| {_f(c['repeats']['p99_spread']['rel_range'], '.1%')} "
            f"| {_f(c['throughput_tasks_per_s'], '.3g')} | " + " | ".join(amps) + " |"
        )
    return rows


def render_report(agg: dict, prov: dict, plot_files: list[str]) -> str:
    sweep = prov["sweep"]
    cfg = sweep["config"]
    plan = sweep["plan"]
    topo = sweep["topology"]
    noise = sweep.get("noise_check", {})
    g_rec = str(cfg["recommend_g"])
    lines = [
        "# Density sweep report",
        "",
        f"- started {sweep.get('started_utc')}, finished {sweep.get('finished_utc')}, "
        f"wall {_f(sweep.get('wall_s'), '.1f')} s",
        f"- host {prov.get('hostname')}: {prov.get('cpu_model')}, kernel {prov.get('kernel')}, "
        f"{plan['num_vcpus']} vCPUs used ({plan['vcpus']}), {topo['num_cores']} cores x "
        f"{topo['threads_per_core']} threads, SMT {'on' if topo['smt_active'] else 'off'}, "
        f"{len(topo['numa_nodes'])} NUMA node(s), {len(topo['l3_domains'])} L3 domain(s), "
        f"{_gib(sweep.get('host_memory', {}).get('mem_total_bytes'))} GiB MemTotal "
        f"({sum(n['mem_total_bytes'] for n in topo['numa_nodes'].values()) / 2**30:.1f} GiB in "
        "NUMA node meminfo)",
        "- backends: "
        + ", ".join(
            f"{k} {v or 'not found'}" for k, v in sweep.get("backend_versions", {}).items()
        ),
        f"- slipstream {prov.get('slipstream')} @ {prov.get('git_commit')}"
        f"{' (dirty tree)' if prov.get('git_dirty') else ''}, Python {prov.get('python')}",
        f"- workload `{sweep['workload']['name']}` (scale {cfg['workload_scale']:g}), "
        f">= {cfg['iterations']} iterations per sandbox x {cfg['repeats']} repeats per cell "
        f"(>= {cfg['min_samples_per_cell']} samples per cell), timeout "
        f"{cfg['timeout_s']:g} s; {agg['num_samples']} samples, {agg['num_failures']} failed",
        f"- idle-host noise check: {noise.get('runs', 0)} runs, p50 {_ms(noise.get('p50_s'))} ms, "
        f"CV {_f(noise.get('cv'), '.3f')} ({noise.get('verdict', 'not run')}); load average "
        f"before {noise.get('loadavg_before')}; 1-min load average at cell starts "
        f"{_load_range(sweep.get('loadavg_1m_per_cell'))} (the sweep itself adds up to the "
        "number of busy sandboxes)",
        "",
    ]
    if plan["not_honoured"]:
        lines += ["## Requested but not honoured on this host", ""]
        lines += [f"- {n['option']} `{n['value']}`: {n['reason']}" for n in plan["not_honoured"]]
        lines.append("")
    if plan["notes"]:
        lines += ["## Notes", ""] + [f"- {n}" for n in plan["notes"]] + [""]

    lines += [
        f"## Recommendation (G = {g_rec}, tolerance {cfg['tolerance']:.0%})",
        "",
        "Highest density whose GRPO amplification (failures counted at the timeout) stays within "
        "the tolerance of the lowest density's, with every lower density also within it. The "
        f"seed's 1.0x rule says {plan['num_vcpus']} sandboxes here (1.0 per vCPU). *Within noise*: "
        "the first exceeding cell's 95% CI still includes the limit.",
        "",
        "| configuration | recommended (per vCPU) | sandboxes | amp | baseline amp | first exceeding "
        "| vs 1.0x rule |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in agg["recommendations"]:
        rec = r.get("recommended")
        if rec is None:
            lines.append(f"| {r['config_id']} | - | - | - | - | - | {r['verdict']} |")
            continue
        lines.append(
            f"| {r['config_id']} | {rec['density']:g} ({_f(rec['sandboxes_per_vcpu'], '.3g')}) "
            f"| {rec['num_sandboxes']} | {_f(rec['amplification'], '.3f')} "
            f"| {_f(r['baseline_amplification'], '.3f')} "
            f"| {_f(r['first_exceeding_density'], 'g')}{' (within noise)' if r['uncertain'] else ''} "
            f"| {r['verdict']} |"
        )
    lines.append("")
    if noise.get("cv") is not None and noise["cv"] > 0.10:
        lines += [
            f"**Caveat:** the idle-host noise check found CV {noise['cv']:.1%} before the sweep: "
            "other load on the host inflates the tails, most visibly at low density (where the "
            "baseline is measured), which makes the recommendation optimistic. Rerun on a quiet "
            "host before acting on it.",
            "",
        ]

    group_sizes = [str(g) for g in cfg["group_sizes"]]
    lines += [
        "## Per configuration",
        "",
        "Latencies over successful samples; spreads are (max - min) / mean of the per-repeat p50 "
        "and p99; amp = E[max of G latencies] / p50 with failures at the timeout; * = fewer than "
        "10*G samples (the max of G is poorly estimated).",
        "",
    ]
    by_config: dict[str, list[dict]] = {}
    for c in agg["cells"]:
        by_config.setdefault(c["config_id"], []).append(c)
    for cid, cells in by_config.items():
        lines += [f"### {cid}", ""] + _cell_rows(cells, group_sizes) + [""]
        failed = [c for c in cells if c["failures"]]
        if failed:
            lines += ["Failures counted at the timeout:", ""]
            for c in failed:
                w = c["with_failures_at_timeout"]
                lines.append(
                    f"- density {c['density']:g}: fail rate {_f(c['fail_rate'], '.2%')}, p50 "
                    f"{_ms(w['p50'])} ms, p99 {_ms(w['p99'])} ms, P(group of {g_rec} has a "
                    f"failure) {_f(c['groups'][g_rec]['p_group_has_failure'], '.1%')}; e.g. "
                    + "; ".join(c["failure_examples"][:2])
                )
            lines.append("")
    lines += [
        "## GRPO group exposure",
        "",
        "P(a group of G rollouts contains a p99 event) = 1 - 0.99^G: "
        + ", ".join(
            f"G={g}: {agg['cells'][0]['groups'][g]['p_group_has_p99_event']:.1%}"
            for g in group_sizes
        )
        if agg["cells"]
        else "",
        "",
    ]
    if plot_files:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plot_files] + [""]
    lines += [
        "Rebuild with `slipstream sweep report <this dir>`; raw samples are in samples.csv, host "
        "and config in provenance.json.",
        "",
    ]
    return "\n".join(lines)


def compare_runs(dir_a: str | Path, dir_b: str | Path) -> str:
    """Markdown side-by-side of two runs' cells (p50, p99, amplification at the chosen G)."""
    runs = []
    for d in (Path(dir_a), Path(dir_b)):
        agg_path = d / AGGREGATES
        if not agg_path.is_file():
            raise FileNotFoundError(f"{agg_path} is missing (run `slipstream sweep report {d}`)")
        runs.append((json.loads(agg_path.read_text()), load_provenance(d)))
    (agg_a, prov_a), (agg_b, prov_b) = runs
    g = str(prov_a["sweep"]["config"]["recommend_g"])
    cells_a = {(c["config_id"], c["density"]): c for c in agg_a["cells"]}
    cells_b = {(c["config_id"], c["density"]): c for c in agg_b["cells"]}
    lines = [
        f"A = {dir_a} ({prov_a.get('cpu_model')}, {prov_a['sweep'].get('started_utc')}, "
        f"commit {str(prov_a.get('git_commit'))[:10]})",
        f"B = {dir_b} ({prov_b.get('cpu_model')}, {prov_b['sweep'].get('started_utc')}, "
        f"commit {str(prov_b.get('git_commit'))[:10]})",
        "",
        f"| configuration | density | p50 ms A | p50 ms B | p99 ms A | p99 ms B | B/A p99 "
        f"| amp G={g} A | amp G={g} B | fail A | fail B |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(set(cells_a) | set(cells_b)):
        a, b = cells_a.get(key), cells_b.get(key)

        def get(c, *path):
            for p in path:
                if c is None:
                    return None
                c = c[p]
            return c

        p99a, p99b = get(a, "successes", "p99"), get(b, "successes", "p99")
        ratio = p99b / p99a if p99a and p99b else None
        lines.append(
            f"| {key[0]} | {key[1]:g} | {_ms(get(a, 'successes', 'p50'))} "
            f"| {_ms(get(b, 'successes', 'p50'))} | {_ms(p99a)} | {_ms(p99b)} | {_f(ratio, '.3f')} "
            f"| {_f(get(a, 'groups', g, 'amplification'), '.3f')} "
            f"| {_f(get(b, 'groups', g, 'amplification'), '.3f')} "
            f"| {_f(get(a, 'fail_rate'), '.1%')} | {_f(get(b, 'fail_rate'), '.1%')} |"
        )
    lines.append("")
    for name, agg in (("A", agg_a), ("B", agg_b)):
        for r in agg["recommendations"]:
            rec = r.get("recommended")
            where = (
                f"{rec['density']:g} per vCPU ({rec['num_sandboxes']} sandboxes)" if rec else "-"
            )
            lines.append(f"- {name} {r['config_id']}: recommended {where}; {r['verdict']}")
    return "\n".join(lines) + "\n"
