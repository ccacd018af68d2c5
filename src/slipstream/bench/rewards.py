"""`slipstream bench rewards`: a slow reward function overlaps generation.

A rollout worker's pipeline, for real: the native engine generates groups (--groups-per-step x
--group-size samples per step, a random model of the config's [model], --max-new-tokens each),
the EpisodeRunner hands each finished completion to the worker's Verifier on a thread pool, and
groups are admitted as the rollout worker admits tasks: --inflight generating at once
(rollout.max_inflight_tasks) and --scoring-tasks more that wait only on their rewards
(rollout.max_scoring_tasks); as a group's completions return or a group finishes, another
starts. The reward is `[[reward.functions]]` with a `python` function that takes --reward-s
seconds per call (time.sleep: a remote judge or a test run), per sample, in --workers reward
processes (slipstream/rewards). Three ways in one run, each timed as the steady-state seconds per
step (per --groups-per-step finished groups, after one warm-up step); generation alone and both
alternate for --rounds rounds and each figure is the median of its rounds:

- generation alone (the task's verifier only): T_gen;
- the reward alone (the same calls, --groups-per-step x --group-size per step, on the same
  pool, no generation): T_reward;
- the figure: both at once, the reward overlapping generation: T_both.

The serial sum T_gen + T_reward is what a pipeline that rewards a step after generating it pays
(verl's naive reward manager). Overhead = T_both / T_gen - 1, the median over the rounds of
each round's ratio (a pair timed seconds apart, under the same load); a step is
generation-bound when T_reward <= T_gen (the per-sample calls' wall time is samples x
reward-s / workers). JSON with provenance in benchmarks/results/rewards.json (or --out). Not covered: a GPU engine, rewards
coalesced into batched calls (each completion is one call here), several rollout workers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

REWARD_S_ENV = "SLIPSTREAM_BENCH_REWARD_S"


def slow_reward(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
    """The benchmark's reward function (runs in the reward processes): REWARD_S_ENV seconds per
    call, then the completion's length share of 64 characters."""
    time.sleep(float(os.environ.get(REWARD_S_ENV, "1.0")))
    return [min(1.0, len(c) / 64) for c in completions]


def register(sub: argparse._SubParsersAction) -> None:
    # imported here: the reward processes import this module for `slow_reward` and need no more
    from slipstream.config.args import add_config_args

    p = sub.add_parser("rewards", help="a slow python reward overlapping generation vs serial",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_config_args(p)
    p.add_argument("--reward-s", type=float, default=1.0, help="seconds per reward call")
    p.add_argument(
        "--workers",
        type=int,
        default=64,
        help="reward processes (reward.workers); 64 makes the reward alone 1 s/step, "
        "under generation's: a generation-bound step",
    )
    p.add_argument("--groups-per-step", type=int, default=8, help="groups per training step")
    p.add_argument("--group-size", type=int, default=8, help="samples per group")
    p.add_argument("--inflight", type=int, default=16,
                   help="groups generating at once (rollout.max_inflight_tasks)")  # fmt: skip
    p.add_argument("--scoring-tasks", type=int, default=None,
                   help="groups held beyond --inflight while they wait only on rewards "
                   "(rollout.max_scoring_tasks; default: the config's; 0: a group holds its "
                   "generation slot until rewarded)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=192, help="tokens per completion")
    p.add_argument(
        "--steps", type=int, default=4, help="timed steps per round (after one warm-up step)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of generation alone and both, alternated; the medians are the figures",
    )
    p.add_argument("--out", default="benchmarks/results/rewards.json", help="JSON output path")
    p.set_defaults(func=run)


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds used so far by this process (all its threads) and the processes `pids`."""
    tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
    total = time.process_time()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # exited (a replaced reward process): its CPU is lost to the count
            continue
        total += (int(fields[11]) + int(fields[12])) * tick_s  # utime + stime
    return total


def _stream(runner: Any, taskset: Any, rollout: Any, pids: list[int],
            args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """Run (1 + steps) x groups-per-step groups, admitted as the rollout worker admits tasks
    (`rollout_room`: at most max_inflight_tasks generating, max_scoring_tasks more waiting on
    their rewards); -> steady-state seconds per step, CPU seconds per step (this process and
    the reward processes `pids`: a figure the host's other load barely moves) and the
    outcomes' statuses."""
    from slipstream.rl.types import rollout_room

    total = (1 + args.steps) * args.groups_per_step
    done_at: list[float] = []
    cpu_at: list[float] = []  # at the end of the warm-up step and of the last step
    statuses: list[str] = []
    live: dict[int, Any] = {}  # group -> its rollout (None until start() returned); on_done not run
    cv = threading.Condition()
    started = 0

    def fill() -> None:  # under cv
        nonlocal started
        while started < total:
            generating = sum(1 for r in live.values() if r is None or r.generating)
            most = rollout.max_inflight_tasks + rollout.max_scoring_tasks
            if rollout_room(rollout.max_inflight_tasks, most, generating, len(live)) <= 0:
                return
            i = started
            started += 1
            live[i] = None
            r = runner.start(taskset.train(i), args.group_size, lambda out, i=i: finished(i, out),
                             seed=i, on_engine_idle=engine_idle)  # fmt: skip
            if i in live:  # not already finished
                live[i] = r

    def finished(i: int, out: Any) -> None:
        with cv:
            done_at.append(time.perf_counter())
            if len(done_at) in (args.groups_per_step, total):
                cpu_at.append(_cpu_s(pids))
            statuses.append(out.status)
            live.pop(i, None)
            fill()
            cv.notify_all()

    def engine_idle() -> None:
        with cv:
            fill()

    with cv:
        fill()
        while len(done_at) < total:
            if not cv.wait(600):
                raise TimeoutError(f"{total - len(done_at)} groups did not finish in 600 s")
    warm = done_at[args.groups_per_step - 1]
    per_step = (done_at[-1] - warm) / args.steps
    cpu_per_step = (cpu_at[-1] - cpu_at[0]) / args.steps
    return {"s_per_step": per_step, "cpu_s_per_step": cpu_per_step,
            "statuses": sorted(set(statuses))}  # fmt: skip


def _reward_alone(reward_set: Any, taskset: Any, args: argparse.Namespace) -> float:
    """Seconds per step of the reward calls alone: a step's samples scored from as many threads
    as there are reward processes (more would only queue for them)."""
    n = args.groups_per_step * args.group_size
    tasks = [taskset.train(i) for i in range(n)]
    with ThreadPoolExecutor(args.workers) as ex:
        list(ex.map(lambda t: reward_set.verify(t, "12"), tasks[: args.workers]))  # warm-up
        t0 = time.perf_counter()
        for _ in range(args.steps):
            list(ex.map(lambda t: reward_set.verify(t, "12"), tasks))
    return (time.perf_counter() - t0) / args.steps


def run(args: argparse.Namespace) -> int:
    import torch

    from slipstream.config import load_config
    from slipstream.config.rm import RewardConfig
    from slipstream.engine import build_engine
    from slipstream.envs import EpisodeLimits, EpisodeRunner, make_env_factory
    from slipstream.model import MoEForCausalLM
    from slipstream.observe.provenance import collect_provenance, write_result
    from slipstream.rewards.rewardset import RewardSet
    from slipstream.rl.verifier import InProcessVerifier
    from slipstream.tasks import get_taskset

    os.environ[REWARD_S_ENV] = str(args.reward_s)  # the reward processes inherit it
    cfg = load_config(args.config, args.overrides)
    taskset = get_taskset(cfg.task)
    tok = taskset.tokenizer
    slots = args.inflight * args.group_size
    seq = max(len(taskset.prompt_ids(taskset.train(i))) for i in range(64)) + args.max_new_tokens
    torch.manual_seed(cfg.run.seed)
    model = MoEForCausalLM(cfg.model.model_copy(update={
        "vocab_size": tok.vocab_size,
        "max_position_embeddings": max(seq, cfg.model.max_position_embeddings)})).eval()  # fmt: skip
    engine = build_engine(cfg.engine.model_copy(update={
        "max_batch_size": slots, "max_seq_len": seq, "kv_cache_tokens": slots * seq}),
        model, tokenizer=tok)  # fmt: skip
    verifier = InProcessVerifier(taskset)
    rc = RewardConfig.model_validate({
        "workers": args.workers, "functions": [
            {"name": "verifier", "kind": "verifier"},
            {"name": "slow", "kind": "python", "function": "slipstream.bench.rewards:slow_reward",
             "timeout_s": args.reward_s + 30.0},
        ]})  # fmt: skip
    reward_set = RewardSet(rc, {"verifier": verifier.verify})
    limits = EpisodeLimits(max_turn_tokens=args.max_new_tokens)
    scoring = cfg.rollout.max_scoring_tasks if args.scoring_tasks is None else args.scoring_tasks
    rollout = cfg.rollout.model_copy(update={"max_inflight_tasks": args.inflight,
                                             "max_scoring_tasks": scoring})  # fmt: skip
    executor = ThreadPoolExecutor(max(32, args.workers * 2), thread_name_prefix="verify")
    try:
        # The two ways alternate, --rounds times each, and each figure is the median of its
        # rounds: on a shared host the load drifts over a minute, and timing one way after the
        # other put that drift into the overhead (runs of -38% and +66% at load 23-27).
        rounds: dict[str, list[float]] = {"generation": [], "both": []}
        cpu: dict[str, list[float]] = {"generation": [], "both": []}
        pids = reward_set.pool.pids() if reward_set.pool is not None else []
        statuses: set[str] = set()
        for _ in range(args.rounds):
            for way, v in (("generation", verifier), ("both", reward_set)):
                runner = EpisodeRunner(engine, make_env_factory(taskset, scorer=v.verify,
                                       limits=limits), tok, limits, executor, context_tokens=seq,
                                       group_scorer=v.score_group)  # fmt: skip
                out = _stream(runner, taskset, rollout, pids, args)
                runner.close()
                rounds[way].append(out["s_per_step"])
                cpu[way].append(out["cpu_s_per_step"])
                statuses.update(out["statuses"])
        t_reward = _reward_alone(reward_set, taskset, args)
    finally:
        reward_set.close()
        executor.shutdown()
        engine.close()
    t_gen, t_both = statistics.median(rounds["generation"]), statistics.median(rounds["both"])
    serial = t_gen + t_reward
    # each round's both-way against the generation-alone run just before it (the pair ran a
    # minute apart, under the same load), the median of the rounds' ratios
    overhead = statistics.median(
        b / g - 1 for g, b in zip(rounds["generation"], rounds["both"], strict=True)
    )
    cpu_overhead = statistics.median(
        b / g - 1 for g, b in zip(cpu["generation"], cpu["both"], strict=True)
    )
    load = os.getloadavg()
    samples = args.groups_per_step * args.group_size
    record = {
        "benchmark": "rewards",
        "figure": {"name": f"s/step, a {args.reward_s:g}-s python reward per sample overlapping "
                           "generation", "value": t_both, "unit": "s/step"},
        "baseline": {"name": "serial sum: generation + reward (measured alone)", "value": serial},
        "limit": {"name": "generation alone", "value": t_gen},
        "reward_alone_s_per_step": t_reward, "overhead_vs_generation": overhead,
        "generation_bound": t_reward <= t_gen, "samples_per_step": samples,
        "reward_s": args.reward_s, "workers": args.workers, "inflight_groups": args.inflight,
        "scoring_groups": scoring,
        "max_new_tokens": args.max_new_tokens, "steps": args.steps, "rounds": args.rounds,
        "generation_s_per_step_rounds": rounds["generation"],
        "both_s_per_step_rounds": rounds["both"],
        "generation_cpu_s_per_step_rounds": cpu["generation"],
        "both_cpu_s_per_step_rounds": cpu["both"], "cpu_overhead_vs_generation": cpu_overhead,
        "statuses": sorted(statuses),
        "params": sum(p.numel() for p in model.parameters()),
        "provenance": collect_provenance({"loadavg_1_5_15": load}),
    }  # fmt: skip
    out = write_result(args.out, record)
    print(f"figure {t_both:.2f} s/step with a {args.reward_s:g}-s reward per sample "
          f"({samples} samples/step, {args.workers} reward processes) | serial sum "
          f"{serial:.2f} s/step (generation {t_gen:.2f} + reward {t_reward:.2f}) | generation "
          f"alone {t_gen:.2f} s/step | overhead {overhead:+.1%} over generation (CPU "
          f"seconds per step: {cpu_overhead:+.1%})"
          f"{'' if t_reward <= t_gen else ' (NOT generation-bound: reward alone is slower)'}; "
          f"CPU {record['provenance']['cpu_model']}, load {load[0]:.1f}\nwrote {out}")  # fmt: skip
    return 0
