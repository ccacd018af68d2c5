"""Final report of an RL run: reward curve PNG (matplotlib, Agg backend) and a Markdown summary
next to the metrics (<run.output_dir>/report.md, reward_curve.png)."""

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


def write_report(
    out_dir: str | Path, summary: dict[str, Any], records: list[dict[str, Any]]
) -> Path:
    """Write reward_curve.png and report.md under out_dir; returns the report path."""
    out_dir = Path(out_dir)
    png = plot_reward_curve(records, out_dir / "reward_curve.png")
    lines = ["# slipstream RL run", ""]
    for k, v in summary.items():
        lines.append(f"- **{k}**: {v:.4g}" if isinstance(v, float) else f"- **{k}**: {v}")
    lines += ["", f"![reward curve]({png.name})", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
