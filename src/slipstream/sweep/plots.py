"""Sweep plots (matplotlib, Agg backend): latency, tail ratio and GRPO amplification vs density.

Each plot is drawn only from aggregates.json, one line per configuration, x = effective sandboxes
per vCPU, with the seed's 1.0x rule marked. PNG metadata is stripped so a rebuild is stable.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

PLOT_FILES = {
    "latency": "latency_vs_density.png",
    "tail_ratio": "tail_ratio_vs_density.png",
    "amplification": "amplification_vs_density.png",
}


def _by_config(agg: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for c in agg["cells"]:
        out[c["config_id"]].append(c)
    return {k: sorted(v, key=lambda c: c["density"]) for k, v in out.items()}


def _x(cells: list[dict], num_vcpus: int) -> list[float]:
    return [c["num_sandboxes"] / num_vcpus for c in cells]


def _finish_density_plot(
    fig, ax, ylabel: str, title: str, out_dir: Path, key: str, meta: dict
) -> str:
    """Shared finish of the single-axis density plots: rule band, labels, save, close."""
    import matplotlib.pyplot as plt  # already imported (Agg backend set) by write_plots

    _mark_rule(ax)
    ax.set_xlabel("sandboxes per vCPU")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / PLOT_FILES[key], metadata=meta)
    plt.close(fig)
    return PLOT_FILES[key]


def _mark_rule(ax) -> None:
    ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.axvspan(1.0, 1.15, color="grey", alpha=0.12, label="1.0x rule cliff (seed 002)")


def _num(v):
    return float("nan") if v is None else v


def write_plots(agg: dict, out_dir: Path) -> list[str]:
    """Write the three PNGs into out_dir; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = _by_config(agg)
    nv = agg["num_vcpus"]
    meta = {"Software": None}
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=90)
    for i, (cid, cells) in enumerate(configs.items()):
        color = f"C{i % 10}"
        ax.plot(
            _x(cells, nv),
            [_num(c["successes"]["p50"]) for c in cells],
            "o--",
            color=color,
            label=f"{cid} p50",
        )
        ax.plot(
            _x(cells, nv),
            [_num(c["successes"]["p99"]) for c in cells],
            "s-",
            color=color,
            label=f"{cid} p99",
        )
    written.append(
        _finish_density_plot(
            fig, ax, "latency (s)", "p50 and p99 latency vs density", out_dir, "latency", meta
        )
    )

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=90)
    for i, (cid, cells) in enumerate(configs.items()):
        ax.plot(
            _x(cells, nv),
            [_num(c["successes"]["p99_p50"]) for c in cells],
            "o-",
            color=f"C{i % 10}",
            label=cid,
        )
    written.append(
        _finish_density_plot(
            fig, ax, "p99 / p50", "tail spread vs density", out_dir, "tail_ratio", meta
        )
    )

    group_sizes = list(agg["cells"][0]["groups"]) if agg["cells"] else []
    fig, axes = plt.subplots(
        1,
        max(1, len(group_sizes)),
        figsize=(4 * max(1, len(group_sizes)), 4),
        dpi=90,
        sharey=True,
        squeeze=False,
    )
    for ax, g in zip(axes[0], group_sizes, strict=False):
        for i, (cid, cells) in enumerate(configs.items()):
            x = _x(cells, nv)
            y = [_num(c["groups"][g]["amplification"]) for c in cells]
            lo = [_num(c["groups"][g]["ci95"][0]) for c in cells]
            hi = [_num(c["groups"][g]["ci95"][1]) for c in cells]
            ax.plot(x, y, "o-", color=f"C{i % 10}", label=cid)
            ax.fill_between(x, lo, hi, color=f"C{i % 10}", alpha=0.15)
        _mark_rule(ax)
        ax.set_title(f"G = {g}")
        ax.set_xlabel("sandboxes per vCPU")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("E[max of G] / p50 (95% CI)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("GRPO group amplification vs density")
    fig.tight_layout()
    fig.savefig(out_dir / PLOT_FILES["amplification"], metadata=meta)
    plt.close(fig)
    written.append(PLOT_FILES["amplification"])
    return written
