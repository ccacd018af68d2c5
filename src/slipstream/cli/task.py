"""`slipstream task check`: the data and the rewards checked before any accelerator is spent."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

from slipstream.cli import add_config_args
from slipstream.config import load_config

if TYPE_CHECKING:
    from rich.console import Console

    from slipstream.config import SlipstreamConfig
    from slipstream.tasks import Task, TaskSet

DESCRIPTION = """\
Loads [task] as a job would and checks it end to end, on this machine, in seconds:

  1. the data: every source is indexed (each row validated: a bad row stops here with one line
     naming file, row and column); per source the files, rows, train / held-out split and the
     rows skipped as longer than task.max_prompt_tokens;
  2. the prompts: a sample rendered through the tokenizer's real chat template (what the policy
     is fed), and the token-length distribution against the context;
  3. the rewards: every [[reward.functions]] entry scores each sampled row's reference answer
     (the SFT target: the completion column, else the answer), which should score 1, and an
     empty completion, which should score 0; the rows and functions that do not are listed.

Exit status: 0 when every reference scored 1 and every empty completion 0; 1 when some did not
(a reward function that cannot recognise its own reference answers will not train); 2 for a
config or data error."""

EPILOG = """\
examples:
  slipstream task check -c configs/own-data.toml
  slipstream task check -c configs/gym.toml --rows 50 --show 5
  slipstream task check -c my.toml --task.train_files="['s3://bucket/train-*.parquet']"
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "task",
        help="check a task's data, prompts and rewards before training (task check)",
        description="Commands about [task]. `slipstream task check -c CONFIG --help` for details.",
    )
    inner = p.add_subparsers(dest="task_command", metavar="SUBCOMMAND")
    check = inner.add_parser(
        "check",
        help="load the data, render prompts, score reference and empty completions",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(check)
    check.add_argument("--rows", type=int, default=200, metavar="N",
                       help="training rows to check (the first N of the shuffled stream: a "
                       "sample of every source by weight), plus up to N held-out rows "
                       "(default 200)")  # fmt: skip
    check.add_argument("--show", type=int, default=3, metavar="N",
                       help="rendered prompts to print (default 3)")  # fmt: skip
    check.add_argument("--no-rewards", action="store_true",
                       help="skip step 3 (no reward processes, reward model or sandboxes)")  # fmt: skip
    check.set_defaults(func=cmd_check)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def cmd_check(args: argparse.Namespace) -> int:
    from rich.console import Console

    cfg = load_config(args.config, args.overrides)
    console = Console(highlight=False)
    from slipstream.tasks import get_taskset

    taskset = get_taskset(cfg.task)
    show_sources(console, cfg, taskset)
    tasks = taskset.train_batch(0, max(0, args.rows)) + taskset.heldout()[: max(0, args.rows)]
    show_prompts(console, cfg, taskset, tasks, args.show)
    if args.no_rewards:
        return 0
    return check_rewards(console, cfg, taskset, tasks)


def show_sources(console: Console, cfg: SlipstreamConfig, taskset: TaskSet) -> None:
    from rich.table import Table

    from slipstream.tasks.dataset import DatasetTaskSet

    if not isinstance(taskset, DatasetTaskSet):
        console.print(f"[bold]task[/bold] {cfg.task.name} (generated; seed {cfg.task.seed})")
        return
    table = Table(title="data sources", title_justify="left")
    for col in ("source", "files", "rows", "train", "held out", "skipped (too long)"):
        table.add_column(col, justify="left" if col == "source" else "right")
    for st in taskset.stats():
        skipped = f"{st.skipped_overlong}" + (
            f" (longest {st.longest_skipped})" if st.skipped_overlong else ""
        )
        table.add_row(
            st.label, str(st.files), str(st.rows), str(st.train), str(st.heldout), skipped
        )
    console.print(table)


def _percentile(sorted_values: list[int], q: float) -> int:
    k = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


def show_prompts(
    console: Console, cfg: SlipstreamConfig, taskset: TaskSet, tasks: list[Task], show: int
) -> None:
    tok = taskset.tokenizer
    lengths = sorted(len(taskset.prompt_ids(t)) for t in tasks)
    for t in tasks[:show]:
        ids = taskset.prompt_ids(t)
        console.rule(f"{t.task_id}  ({len(ids)} tokens)", style="dim")
        console.print(tok.decode(ids, skip_special_tokens=False), markup=False)
    if not lengths:
        return
    context = cfg.model.max_position_embeddings
    completion = cfg.rollout.max_new_tokens or cfg.engine.max_new_tokens
    budget = cfg.task.max_prompt_tokens
    over = sum(n > budget for n in lengths)
    console.rule(style="dim")
    console.print(
        f"[bold]prompt tokens[/bold] over {len(lengths)} prompts: min {lengths[0]}, "
        f"p50 {_percentile(lengths, 0.5)}, p90 {_percentile(lengths, 0.9)}, "
        f"p99 {_percentile(lengths, 0.99)}, max {lengths[-1]}"
    )
    console.print(
        f"context {context} = prompt budget {budget} (task.max_prompt_tokens) + completion cap "
        f"{completion}: {over} of {len(lengths)} sampled prompts exceed the budget"
        + ("" if cfg.task.name != "dataset" else " (too-long rows are skipped or refused at load)")
    )


def _reference(taskset: TaskSet, task: Task) -> str | None:
    try:
        return taskset.reference(task)
    except (ValueError, KeyError):
        return None


def check_rewards(
    console: Console, cfg: SlipstreamConfig, taskset: TaskSet, tasks: list[Task]
) -> int:
    from rich.table import Table

    from slipstream.rm.source import score_pairs

    refs = [(t, _reference(taskset, t)) for t in tasks]
    with_ref = [(t, r) for t, r in refs if r is not None]
    pairs = [(t, r) for t, r in with_ref] + [(t, "") for t, _ in with_ref]
    console.print(
        f"[bold]rewards[/bold]: {len(cfg.reward.functions)} function(s) on {len(with_ref)} "
        f"reference answers and as many empty completions"
        + (
            f" ({len(refs) - len(with_ref)} rows have no reference)"
            if len(with_ref) < len(refs)
            else ""
        )
    )
    if not pairs:
        return 0
    results = score_pairs(cfg, pairs)
    n = len(with_ref)
    names = list(results[0]) if results else []
    summary = Table(title="reward check", title_justify="left")
    for col in ("function", "kind", "weight", "reference = 1", "empty = 0", "None", "errors"):
        summary.add_column(col, justify="left" if col in ("function", "kind") else "right")
    kinds = {f.name: (f.kind, f.weight) for f in cfg.reward.functions}
    bad: list[tuple[str, str, str, Any]] = []
    for name in names:
        ok_ref = ok_empty = nones = errors = 0
        for k, res in enumerate(results):
            value = res[name]
            is_ref = k < n
            task, text = pairs[k]
            if value is None:
                nones += 1
                continue
            if isinstance(value, str):
                errors += 1
                bad.append(
                    (
                        name,
                        task.meta.get("origin", task.task_id),
                        "reference" if is_ref else "empty",
                        value,
                    )
                )
                continue
            good = value == 1.0 if is_ref else value == 0.0
            ok_ref += good and is_ref
            ok_empty += good and not is_ref
            if not good:
                bad.append(
                    (
                        name,
                        task.meta.get("origin", task.task_id),
                        "reference" if is_ref else "empty",
                        value,
                    )
                )
        kind, weight = kinds.get(name, ("?", 0.0))
        summary.add_row(
            name, kind, f"{weight:g}", f"{ok_ref}/{n}", f"{ok_empty}/{n}", str(nones), str(errors)
        )
    console.print(summary)
    if not bad:
        console.print("[green]every reference answer scored 1 and every empty completion 0[/green]")
        return 0
    listing = Table(title=f"{len(bad)} results not as expected (first 20)", title_justify="left")
    for col in ("function", "row", "completion", "got"):
        listing.add_column(col)
    for name, origin, which, value in bad[:20]:
        listing.add_row(name, str(origin), which, str(value)[:80])
    console.print(listing)
    return 1
