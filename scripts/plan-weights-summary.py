"""Measured vs predicted samples/s of scripts/plan-weights.sh's runs (issue 31): every rates
file simulated (`slipstream plan simulate`'s simulator); prints one line per seed, writes summary.json.

    python scripts/plan-weights-summary.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path


def simulate(path: Path) -> dict:
    from slipstream.plan import load_rates
    from slipstream.plan import simulate as run

    return run(load_rates(path)).to_dict()


def measured(path: Path) -> dict:
    return tomllib.loads(path.read_text())["calibration"]["measured"]


def main(out: Path) -> None:
    rows = []
    for d in sorted(out.glob("distributed-s*")):
        if not d.is_dir():
            continue
        seed = d.name.removeprefix("distributed-s")
        s = out / f"store-s{seed}"
        md, ms = measured(d / "rates.toml"), measured(s / "rates.toml")
        pd, ps = simulate(d / "rates.toml"), simulate(s / "rates.toml")
        pw = simulate(s / "rates-push.toml")
        row = {"seed": int(seed), "push_s_mean_in_run": md["push_s_mean"],
               "distributed_measured": md["samples_per_s"],
               "distributed_idle_measured": md["trainer_idle_frac"],
               "distributed_predicted": pd["samples_per_s"],
               "distributed_idle_predicted": pd["trainer_idle_frac"],
               "store_measured": ms["samples_per_s"], "store_idle_measured": ms["trainer_idle_frac"],
               "store_predicted": ps["samples_per_s"], "store_idle_predicted": ps["trainer_idle_frac"],
               "what_if_push_predicted": pw["samples_per_s"]}  # fmt: skip
        rows.append(row)
        dm = row["distributed_measured"]
        print(f"seed {seed}: distributed measured {dm:.1f} samples/s, predicted from its own run "
              f"{row['distributed_predicted']:.1f} ({row['distributed_predicted'] / dm - 1:+.1%}; "
              f"push {row['push_s_mean_in_run'] * 1e3:.1f} ms) | store measured "
              f"{row['store_measured']:.1f}, predicted {row['store_predicted']:.1f} "
              f"({row['store_predicted'] / row['store_measured'] - 1:+.1%}) | pushed, predicted "
              f"from the store run + bench weights {row['what_if_push_predicted']:.1f} "
              f"({row['what_if_push_predicted'] / dm - 1:+.1%} of the measured push run)")  # fmt: skip
    (out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
