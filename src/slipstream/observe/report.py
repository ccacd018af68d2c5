"""Final report of an RL run: reward curve PNG (matplotlib, Agg backend) and a Markdown summary
next to the metrics (<run.output_dir>/report.md, reward_curve.png); with `[[reward.functions]]`
also each component's mean and None share per step, with its failed calls and drops
(reward_components.png, docs/rewards.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_reward_curve(records: list[dict[str, Any]], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records if "reward_mean" in r]
    rewards = [r["reward_mean"] for r in records if "reward_mean" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, lw=1, alpha=0.5, label="batch reward")
    w = max(1, len(rewards) // 10)
    if len(rewards) >= w > 1:
        smooth = [
            sum(rewards[max(0, i - w + 1) : i + 1]) / len(rewards[max(0, i - w + 1) : i + 1])
            for i in range(len(rewards))
        ]
        ax.plot(steps, smooth, lw=2, label=f"moving mean ({w} steps)")
    evals = [
        (r["step"], r["pass_at_1"])
        for r in records
        if r.get("evaluated") and r.get("pass_at_1") is not None
    ]
    if evals:
        ax.plot([e[0] for e in evals], [e[1] for e in evals], "o--", label="held-out pass@1")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward / pass@1")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def reward_components(records: list[dict[str, Any]]) -> list[str]:
    """The reward functions whose per-step means the records hold (`reward/<name>/mean`)."""
    names: dict[str, None] = {}
    for r in records:
        for k in r:
            if k.startswith("reward/") and k.endswith("/mean"):
                names[k[len("reward/") : -len("/mean")]] = None
    return list(names)


def plot_reward_components(records: list[dict[str, Any]], path: str | Path) -> Path | None:
    """Each component's mean per step (top), its None share (middle) and its failed calls and
    dropped samples so far (bottom); None when the run has no components."""
    names = reward_components(records)
    if not names:
        return None
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if "step" in r and any(f"reward/{n}/mean" in r for n in names)]
    steps = [r["step"] for r in rows]
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    for n in names:
        mean = [r.get(f"reward/{n}/mean", math.nan) for r in rows]
        top.plot(steps, [math.nan if v is None else v for v in mean], lw=1.2, label=n)
        mid.plot(steps, [r.get(f"reward/{n}/none", math.nan) for r in rows], lw=1.2, label=n)
        for counter, style in (("failed_calls", "-"), ("dropped", ":")):
            vals = [r.get(f"reward/{n}/{counter}", math.nan) for r in rows]
            if any(v == v and v > 0 for v in vals):
                low.plot(steps, vals, style, lw=1.2, label=f"{n} {counter}")
    top.set_ylabel("mean score")
    mid.set_ylabel("share None")
    mid.set_ylim(-0.02, 1.02)
    low.set_ylabel("failed calls / drops")
    low.set_xlabel("trainer step")
    for ax in (top, mid, low):
        ax.grid(alpha=0.3)
    top.legend(loc="best", fontsize=8)
    if low.get_legend_handles_labels()[0]:
        low.legend(loc="best", fontsize=8)
    else:
        low.text(0.5, 0.5, "no failed calls", ha="center", va="center", transform=low.transAxes)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(
    out_dir: str | Path, summary: dict[str, Any], records: list[dict[str, Any]]
) -> Path:
    """Write reward_curve.png (and reward_components.png) and report.md under out_dir; returns
    the report path."""
    out_dir = Path(out_dir)
    png = plot_reward_curve(records, out_dir / "reward_curve.png")
    lines = ["# slipstream RL run", ""]
    for k, v in summary.items():
        lines.append(f"- **{k}**: {v:.4g}" if isinstance(v, float) else f"- **{k}**: {v}")
    lines += ["", f"![reward curve]({png.name})", ""]
    components = plot_reward_components(records, out_dir / "reward_components.png")
    if components is not None:
        lines += [f"![reward components]({components.name})", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
