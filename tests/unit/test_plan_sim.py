"""The simulator against closed forms, Little's law and its own invariants (no timing
assertions: every figure is simulated time)."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from slipstream.plan import PlanConfig, simulate, with_overrides

# A rollout side far faster than the trainer: no lease backoff, no RPC, no weight cost.
FAST = [
    "rollout.lease_rpc_s=0", "rollout.ack_rpc_s=0", "rollout.lease_backoff_min_s=1e-6",
    "rollout.lease_backoff_max_s=1e-6", "rollout.engine.weight_fetch_s=0",
    "rollout.engine.weight_apply_s=0", "rollout.engine.step_per_token_s=0",
]  # fmt: skip


def harmonic(n: int) -> float:
    return sum(1.0 / i for i in range(1, n + 1))


def test_importing_and_simulating_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "import slipstream.plan, slipstream.plan.calibrate, slipstream.plan.search\n"
        "import slipstream.plan.validate, slipstream.cli.plan\n"
        "from slipstream.plan import load_rates, simulate\n"
        "simulate(load_rates('configs/plan/p5en-48.toml', ['loop.steps=5', 'loop.warmup_steps=1']))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_trainer_bound_loop_runs_at_the_trainer_rate() -> None:
    plan = with_overrides(PlanConfig(), [*FAST, "trainer.step_s.value=0.5", "trainer.overhead_s=0.01",
                                         "rollout.engine.step_fixed_s=1e-4", "loop.steps=200"])  # fmt: skip
    res = simulate(plan)
    assert res.samples_per_s == pytest.approx(64 / 0.51, rel=1e-6)
    assert res.trainer_idle_frac < 1e-6


def test_sync_cycle_is_step_plus_generation_plus_slowest_of_the_batch() -> None:
    # sync, one instance that leases the whole batch at once: cycle = step + generation of L
    # tokens (one engine step per token) + the max of gps x G exponential verifications.
    gps, group, mean_verify, step, length, tok_s = 4, 8, 0.05, 0.2, 5, 0.002
    plan = with_overrides(PlanConfig(), [
        *FAST, "loop.mode=sync", f"loop.groups_per_step={gps}", f"loop.group_size={group}",
        "loop.steps=3000", f"trainer.step_s.value={step}", f"rollout.engine.step_fixed_s={tok_s}",
        f"rollout.engine.completion_tokens.value={length}", "rollout.engine.max_new_tokens=16",
        f"rollout.tasks_per_lease={gps}", f"rollout.max_inflight_tasks={gps}",
        f'verifier.latency_s={{kind="exponential", value={mean_verify}}}',
    ])  # fmt: skip
    res = simulate(plan)
    cycle = step + length * tok_s + mean_verify * harmonic(gps * group)
    assert res.samples_per_s == pytest.approx(gps * group / cycle, rel=0.02)
    assert res.trainer_idle_frac == pytest.approx(1 - step / cycle, rel=0.03)


def test_rollout_bound_async_throughput_is_closed_loop_capacity() -> None:
    # Admission never binds (huge staleness), the trainer is instant, every instance keeps m tasks
    # in flight, each until it is verified (max_scoring_tasks = 0): groups/s = N m / E[cycle],
    # cycle = generation + E[max of G exponentials].
    n_inst, m, group, mean_verify, length, tok_s = 3, 4, 4, 0.1, 3, 0.001
    loop = [
        *FAST, "loop.max_staleness=1000", "loop.groups_per_step=4", f"loop.group_size={group}",
        "loop.steps=3000", "loop.warmup_steps=50", "trainer.step_s.value=1e-9",
        f"rollout.num_instances={n_inst}", f"rollout.max_inflight_tasks={m}",
        "rollout.tasks_per_lease=1", f"rollout.engine.step_fixed_s={tok_s}",
        f"rollout.engine.completion_tokens.value={length}",
        f'verifier.latency_s={{kind="exponential", value={mean_verify}}}',
    ]  # fmt: skip
    res = simulate(with_overrides(PlanConfig(), [*loop, "rollout.max_scoring_tasks=0"]))
    cycle = length * tok_s + mean_verify * harmonic(group)
    assert res.samples_per_s / group == pytest.approx(n_inst * m / cycle, rel=0.03)


def test_tasks_being_verified_leave_their_generation_slots() -> None:
    # As above, but a verified group no longer holds one of the m generation slots (enough
    # max_scoring_tasks and verification threads for the groups a cycle verifies): the engines
    # generate all the time, groups/s = N m / generation time, a group's generation being its
    # `length` steps and the step it waits for (it is submitted while the next step runs).
    n_inst, m, group, mean_verify, length, tok_s = 3, 4, 4, 0.1, 3, 0.05
    plan = with_overrides(PlanConfig(), [
        *FAST, "loop.max_staleness=1000", "loop.groups_per_step=4", f"loop.group_size={group}",
        "loop.steps=1500", "loop.warmup_steps=50", "trainer.step_s.value=1e-9",
        f"rollout.num_instances={n_inst}", f"rollout.max_inflight_tasks={m}",
        "rollout.max_scoring_tasks=32", "verifier.concurrency_per_instance=256",
        "rollout.tasks_per_lease=1", f"rollout.engine.step_fixed_s={tok_s}",
        f"rollout.engine.completion_tokens.value={length}",
        f'verifier.latency_s={{kind="exponential", value={mean_verify}}}',
    ])  # fmt: skip
    res = simulate(plan)
    generation_s = (length + 1) * tok_s
    assert res.samples_per_s / group == pytest.approx(n_inst * m / generation_s, rel=0.03)


def test_littles_law_holds_for_tasks_in_flight() -> None:
    plan = with_overrides(PlanConfig(), [
        'verifier.latency_s={kind="lognormal", p50=0.2, p99_over_p50=4.0}',
        "rollout.num_instances=3", "loop.steps=400",
    ])  # fmt: skip
    res = simulate(plan)
    # L = lambda W over the whole run (no Spot: every task leaves in-flight by an ack)
    assert res.mean_in_flight == pytest.approx(
        res.completion_rate_per_s * res.mean_in_flight_time_s, rel=0.03
    )


@pytest.mark.parametrize("seed", range(6))
def test_staleness_bound_is_never_exceeded(seed: int) -> None:
    rng = np.random.default_rng(seed)
    bound = int(rng.integers(0, 4))
    plan = with_overrides(PlanConfig(), [
        f"loop.max_staleness={bound}", f"loop.seed={seed}", "loop.steps=150",
        f"rollout.num_instances={int(rng.integers(1, 5))}",
        f"rollout.max_inflight_tasks={int(rng.integers(1, 16))}",
        f"rollout.tasks_per_lease={int(rng.integers(1, 8))}",
        f"loop.partial_rollouts={'true' if seed % 2 else 'false'}",
        f'verifier.latency_s={{kind="lognormal", p50={rng.uniform(0.01, 0.5)}, p99_over_p50=6.0}}',
        f"trainer.step_s.value={rng.uniform(0.01, 0.3)}",
        "rollout.spot_fraction=1", "rollout.spot.interruptions_per_node_hour=200",
        "rollout.spot.notice_s=1", "rollout.spot.replace_s=1", "rollout.spot.drain_timeout_s=0.3",
    ])  # fmt: skip
    res = simulate(plan)
    assert res.staleness_violations == 0
    assert max(res.staleness_hist) <= bound
    assert sum(res.staleness_hist.values()) == plan.loop.steps * plan.loop.groups_per_step


def test_spot_availability_matches_the_renewal_closed_form() -> None:
    # notice every 1/lambda s of up time; each costs notice + replace s of down time (drain ~0)
    rate_h, notice, replace = 180.0, 2.0, 6.0
    plan = with_overrides(PlanConfig(), [
        "rollout.spot_fraction=1", f"rollout.spot.interruptions_per_node_hour={rate_h}",
        f"rollout.spot.notice_s={notice}", f"rollout.spot.replace_s={replace}",
        "rollout.spot.drain_timeout_s=0", "rollout.num_instances=12", "loop.steps=500",
        "trainer.step_s.value=1.0",
    ])  # fmt: skip
    res = simulate(plan)
    up = 3600 / rate_h
    assert res.interruptions > 150
    assert res.instance_up_frac == pytest.approx(up / (up + notice + replace), rel=0.05)


def test_same_seed_same_result_and_seed_changes_draws() -> None:
    plan = with_overrides(PlanConfig(), ['verifier.latency_s={kind="lognormal", p50=0.1, p99_over_p50=4.0}',
                                         "loop.steps=50"])  # fmt: skip
    a, b = simulate(plan), simulate(plan)
    assert a.samples_per_s == b.samples_per_s and a.staleness_hist == b.staleness_hist
    other = simulate(with_overrides(plan, ["loop.seed=7"]))
    assert other.samples_per_s != a.samples_per_s


def test_p5en_example_is_trainer_or_rollout_bound_consistently() -> None:
    from slipstream.plan import load_rates
    from slipstream.plan.search import at_split

    plan = load_rates("configs/plan/p5en-48.toml", ["loop.steps=8", "loop.warmup_steps=2"])
    few, many = simulate(at_split(plan, 8)), simulate(at_split(plan, 32))
    # more trainer nodes -> shorter steps; fewer rollout instances -> the trainer waits more
    assert many.mean_train_s < few.mean_train_s
    assert many.trainer_idle_frac > few.trainer_idle_frac
    assert math.isfinite(few.samples_per_s) and few.samples_per_s > 0


def test_backoff_chain_and_notify_follow_the_worker_loop() -> None:
    from slipstream.plan.instance import backoff_chain, wake_on_notify

    # waits 5, 10, 20, 40, 50, 50 ms, each followed by a 1 ms iteration
    ends = [0.006, 0.017, 0.038, 0.079, 0.130, 0.181]
    for i, end in enumerate(ends):
        t, idle = backoff_chain(0.0, 0.005, end - 1e-9, 0.001, 0.05)
        assert t == pytest.approx(end) and idle == pytest.approx(min(0.005 * 2 ** (i + 1), 0.05))
    assert backoff_chain(0.0, 0.005, 10.0, 0.001, 0.05)[0] == pytest.approx(
        0.130 + 0.051 * math.ceil((10.0 - 0.130) / 0.051)
    )
    assert wake_on_notify(0.0, 0.005, 0.012, 0.001, 0.05) == pytest.approx((0.012, 0.02))
    assert wake_on_notify(0.0, 0.005, 0.0055, 0.001, 0.05) == pytest.approx((0.006, 0.01))
    # a notify before the wait began is lost: the wait runs in full
    assert wake_on_notify(1.0, 0.005, 0.9, 0.001, 0.05) == pytest.approx((1.005, 0.01))


def test_pushed_weights_cost_the_trainer_the_push_at_the_live_instance_count() -> None:
    """weights.sync = distributed: the push (interpolated over the measured engine counts and
    scaled by bytes) sits in the trainer's step, so a trainer-bound loop runs at 1 / (step +
    push); the store copy of every store_every-th version adds its write; no fetch is paid."""
    from slipstream.plan.rates import WeightRates

    w = WeightRates(sync="distributed", push_s=[(1, 0.1), (2, 0.2), (4, 0.3)], push_bytes=1000)
    assert [w.push_seconds(n) for n in (1, 2, 3, 4)] == pytest.approx([0.1, 0.2, 0.25, 0.3])
    assert w.push_seconds(8) == pytest.approx(0.5)  # extended along the last two points
    assert w.push_seconds(0) == 0.0
    half = w.model_copy(update={"version_bytes": 500})
    assert half.push_seconds(3) == pytest.approx(0.125)
    base = [*FAST, "trainer.step_s.value=0.5", "rollout.engine.step_fixed_s=1e-4",
            "loop.steps=200", "rollout.num_instances=3", "rollout.engine.weight_fetch_s=5.0"]  # fmt: skip
    pushed = [*base, "weights.sync=distributed", "weights.push_s=[[1, 0.1], [2, 0.2], [4, 0.3]]",
              "weights.push_bytes=1000"]  # fmt: skip
    res = simulate(with_overrides(PlanConfig(), pushed))
    assert res.samples_per_s == pytest.approx(64 / 0.75, rel=1e-6)  # 0.5 + push to 3 = 0.25
    assert res.mean_train_s == pytest.approx(0.75, rel=1e-6)
    # the store write of v1 and every 10th version inside those steps
    stored = simulate(with_overrides(PlanConfig(), [*pushed, "weights.store_write_s=1.0"]))
    assert stored.mean_train_s == pytest.approx(0.75 + 1.0 / 10, rel=0.05)
    # the store path with the same 5 s fetch: a worker fetches before its next lease and the
    # trainer starves; pushed versions are never fetched
    store = simulate(with_overrides(PlanConfig(), base))
    assert store.samples_per_s < res.samples_per_s / 2 and store.trainer_idle_frac > 0.5


def test_pushed_weights_need_measured_push_times() -> None:
    from slipstream.config.base import ConfigError

    with pytest.raises(ConfigError, match="push_s.*plan calibrate --weights-bench"):
        with_overrides(PlanConfig(), ["weights.sync=distributed"])
    with pytest.raises(ConfigError, match="increasing"):
        with_overrides(PlanConfig(), ["weights.sync=distributed", "weights.push_bytes=1",
                                      "weights.push_s=[[2, 0.1], [1, 0.2]]"])  # fmt: skip
