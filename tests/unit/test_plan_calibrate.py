"""`plan calibrate` on a synthetic finished run: what it reads, what it derives, the fit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from slipstream.config import load_config
from slipstream.plan.calibrate import (
    calibrate,
    discrete_lengths,
    engine_curve,
    probe_rpc,
    probe_weight_load,
    read_worker_stats,
)
from slipstream.plan.results import figures_from_metrics

NUM_STEPS = 30
PROBES = {"weight_fetch_s": 0.01, "weight_apply_s": 0.001, "rpc_idle_s": 3e-4, "rpc_busy_s": 2e-3}


def make_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    rng = np.random.default_rng(0)
    lines, t = [], 0.0
    for step in range(1, NUM_STEPS + 1):
        idle, train = (2.0 if step == 1 else 0.01), 0.1 + 0.01 * (step % 3)
        t += idle + train + 0.001
        lines.append(json.dumps({"step": step, "idle_s": idle, "train_s": train, "elapsed_s": t,
                                 "num_samples": 64.0,
                                 "completion_len_mean": 3.0 + 0.2 * rng.standard_normal()}))  # fmt: skip
    lines.append(json.dumps({"event": "end", "wall_s": t}))
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    logs = run / "launch" / "logs"
    logs.mkdir(parents=True)
    stats = {"groups_acked": 240, "groups_rejected": 0, "tasks_nacked": 0, "samples": 1920,
             "tokens": 5760, "weight_updates": 29, "leases": 60, "verify_s": 0.0096,
             "generate_s": 12.0}  # fmt: skip
    (logs / "w0.0.log").write_text(
        "2026-01-01 00:00:00,000 w0.0 WARNING worker w0.0: something else\n"
        f"2026-01-01 00:00:09,000 w0.0 INFO exiting 0: {stats!r}\n"
    )
    vdir = run / "store" / "weights" / "v00000030"
    vdir.mkdir(parents=True)
    data = np.arange(4096, dtype=np.float32).tobytes()
    header = json.dumps({"w": {"dtype": "F32", "shape": [4096], "data_offsets": [0, len(data)]}})
    hb = header.encode()
    (vdir / "model.safetensors").write_bytes(len(hb).to_bytes(8, "little") + hb + data)
    (vdir / "manifest.json").write_text("{}")
    return run


def make_bench(tmp_path: Path) -> Path:
    mc = {"hidden_size": 128, "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2}
    results = [
        {"model_config": mc, "native": {"engine_stats": {"decode_rows": 20 * 100,
                                                          "decode_steps": 100, "step_s": 0.5}}},
        {"model_config": mc, "native": {"engine_stats": {"decode_rows": 40 * 100,
                                                          "decode_steps": 100, "step_s": 0.7}}},
        {"model_config": {**mc, "hidden_size": 256},
         "native": {"engine_stats": {"decode_rows": 1, "decode_steps": 1, "step_s": 9.0}}},
    ]  # fmt: skip
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"results": results}))
    return path


def test_figures_from_metrics_by_hand(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    fig = figures_from_metrics(recs, warmup=2)
    steps = [r for r in recs if "train_s" in r]
    window = steps[-1]["elapsed_s"] - steps[1]["elapsed_s"]
    assert fig["samples_per_s"] == pytest.approx(64 * (NUM_STEPS - 2) / window)
    assert fig["trainer_idle_frac"] == pytest.approx(0.01 * (NUM_STEPS - 2) / window)
    assert fig["overhead_s_mean"] == pytest.approx(0.001, abs=1e-9)


def test_reads_worker_stats_engine_curve_and_weights(tmp_path: Path) -> None:
    run, bench = make_run(tmp_path), make_bench(tmp_path)
    (stats,) = read_worker_stats(run)
    assert stats["generate_s"] == 12.0 and stats["groups_acked"] == 240
    fixed, per_token, _ = engine_curve(bench, {"hidden_size": 128, "num_hidden_layers": 4,
                                               "num_experts": 8, "num_experts_per_tok": 2})  # fmt: skip
    assert per_token == pytest.approx((0.007 - 0.005) / 20)
    assert fixed == pytest.approx(0.005 - 20 * per_token)
    with pytest.raises(ValueError, match="need two batch sizes"):
        engine_curve(bench, {"hidden_size": 256, "num_hidden_layers": 4, "num_experts": 8,
                             "num_experts_per_tok": 2})  # fmt: skip
    fetch, apply = probe_weight_load(run / "store" / "weights", repeats=3)
    assert fetch > 0 and apply > 0
    idle, busy = probe_rpc(num_calls=10, repeats=1)  # a real server process on loopback
    assert 0 < idle < 1 and 0 < busy < 1
    with pytest.raises(FileNotFoundError):
        probe_weight_load(tmp_path / "empty")


def test_calibrate_builds_rates_from_the_run_and_fits_the_latency(tmp_path: Path) -> None:
    run, bench = make_run(tmp_path), make_bench(tmp_path)
    job = load_config("configs/quickstart.toml", ["trainer.mode=sync", "rollout.num_workers=1",
                                                   f"trainer.steps={NUM_STEPS}"])  # fmt: skip
    plan = calibrate(run, job, engine_bench=bench, warmup_steps=2, probes=PROBES)
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][:-1]
    assert plan.trainer.step_s.values == [r["train_s"] for r in steps]
    assert plan.trainer.step_s.order == "sequential"
    assert plan.loop.mode == "sync" and plan.loop.staleness_bound == 0
    assert plan.loop.steps == NUM_STEPS and plan.rollout.num_instances == 1
    m = plan.calibration.measured
    assert m["request_latency_s"] == pytest.approx(12.0 / 240)
    lengths = plan.rollout.engine.completion_tokens.values
    assert np.mean(lengths) == pytest.approx(5760 / 1920, abs=0.01)
    assert plan.rollout.engine.length_per == "group"
    assert plan.verifier.latency_s.value == pytest.approx(0.0096 / 1920)
    # the fit: the simulated request latency equals the measured one
    assert m["fitted_request_latency_s"] == pytest.approx(m["request_latency_s"], rel=0.01)
    assert plan.rollout.engine.slowdown == m["fitted_slowdown"]
    assert plan.rollout.rpc_busy_s == PROBES["rpc_busy_s"]
    assert plan.rollout.engine.weight_fetch_s == PROBES["weight_fetch_s"]
    # the quickstart drops uniform groups, which the simulator does not: said in the notes
    warning = "WARNING: the run used buffer.dynamic_sampling"
    assert job.buffer.dynamic_sampling
    assert any(n.startswith(warning) for n in plan.calibration.notes)
    off = load_config("configs/quickstart.toml", ["trainer.mode=sync", "rollout.num_workers=1",
                                                   f"trainer.steps={NUM_STEPS}",
                                                   "buffer.dynamic_sampling=false"])  # fmt: skip
    notes = calibrate(run, off, engine_bench=bench, probes=PROBES, fit=False).calibration.notes
    assert not any(n.startswith(warning) for n in notes)


def test_heavy_verifier_delay_is_not_counted_twice(tmp_path: Path) -> None:
    run, bench = make_run(tmp_path), make_bench(tmp_path)
    job = load_config("configs/quickstart.toml", ["rollout.verify_latency=lognormal",
                                                   "rollout.verify_latency_p50_s=0.25"])  # fmt: skip
    plan = calibrate(run, job, engine_bench=bench, warmup_steps=2, fit=False, probes=PROBES)
    lat = plan.verifier.latency_s
    assert lat.kind == "lognormal" and lat.p50 == 0.25 and lat.shift == 0.0


def test_discrete_lengths_keep_mean_and_spread() -> None:
    for mean, sd in [(3.0, 0.5), (2.7, 0.3), (120.0, 40.0), (1.2, 0.0)]:
        v = np.array(discrete_lengths(mean, sd))
        frac = mean - np.floor(mean)
        least_sd = np.sqrt(frac * (1 - frac))  # integers with this mean cannot spread less
        assert v.mean() == pytest.approx(mean, abs=0.01)
        assert v.std() == pytest.approx(max(sd, least_sd), abs=0.02 * max(1, sd))
        assert v.min() >= 1


def test_engine_weight_probe_failure_falls_back_to_numpy(tmp_path: Path, caplog) -> None:
    from slipstream.plan.calibrate import run_probes

    run = make_run(tmp_path)  # its store holds no loadable model: the engine probe must fail
    with caplog.at_level("WARNING"):
        probes = run_probes(run, 1, rpc_calls=10)
    assert probes["weight_probe"] == "numpy" and probes["weight_fetch_s"] > 0
    assert "numpy imitation" in caplog.text and "probe" in caplog.text


@pytest.mark.slow  # a subprocess that imports torch and builds the engine: ~10-20 s
def test_engine_weight_probe_times_the_factory_built_native_engine(tmp_path: Path) -> None:
    import torch

    from slipstream.config.model import ModelConfig
    from slipstream.model import MoEForCausalLM, hf_config_from_model_config, hf_from_internal
    from slipstream.plan.calibrate import probe_engine_weight_load
    from slipstream.storage.weights import WeightStore

    cfg = ModelConfig(vocab_size=64, num_hidden_layers=2)
    torch.manual_seed(0)
    state = MoEForCausalLM(cfg).state_dict()
    dtype = next(iter(state.values())).dtype
    WeightStore(str(tmp_path / "store")).publish(
        1, hf_from_internal(state, cfg), hf_config_from_model_config(cfg, dtype)
    )
    got = probe_engine_weight_load(tmp_path / "store", 1, repeats=2)
    assert got["fetch_s"] > 0 and got["apply_s"] > 0 and got["step_s"] > 0
    assert got["batch_rows"] == 8.0  # the probe's request: 8 samples decoded together


def _weights_bench(tmp_path: Path) -> Path:
    rows = [{"engines": 1, "bytes": 4096 * 4 * 1000, "distributed_s": 1.0},
            {"engines": 2, "bytes": 4096 * 4 * 1000, "distributed_s": 1.5}]  # fmt: skip
    path = tmp_path / "weights.json"
    path.write_text(json.dumps({"benchmark": "weights", "rows": rows}))
    return path


def test_calibrate_plans_a_store_run_with_pushed_weights_from_bench_weights(tmp_path: Path) -> None:
    """--weights-bench: the bench's (engines, distributed_s) rows become the push times,
    scaled to the run's version bytes (read from its newest stored version's header)."""
    from slipstream.plan.calibrate import version_bytes

    run, bench = make_run(tmp_path), make_bench(tmp_path)
    assert version_bytes(run / "store" / "weights") == 4096 * 4
    job = load_config("configs/quickstart.toml", ["trainer.mode=sync", "rollout.num_workers=2",
                                                   f"trainer.steps={NUM_STEPS}"])  # fmt: skip
    plan = calibrate(run, job, engine_bench=bench, warmup_steps=2, probes=PROBES, fit=False,
                     weights_bench=_weights_bench(tmp_path))  # fmt: skip
    w = plan.weights
    assert w.sync == "distributed" and w.push_s == [(1, 1.0), (2, 1.5)]
    assert w.push_seconds(2) == pytest.approx(1.5 / 1000)  # the run's model is 1000x smaller
    assert any("weights pushed (what-if" in n for n in plan.calibration.notes)
    assert any("bench pushed 1e+03x this run's bytes" in n for n in plan.calibration.notes)
    with pytest.raises(ValueError, match="not a `slipstream bench weights` result"):
        calibrate(run, job, engine_bench=bench, probes=PROBES, fit=False, weights_bench=bench)


def test_calibrate_takes_a_pushing_runs_own_push_out_of_its_steps(tmp_path: Path) -> None:
    run, bench = make_run(tmp_path), make_bench(tmp_path)
    metrics = run / "metrics.jsonl"
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    for r in recs[:-1]:
        r["weight_served_s_max"] = 0.04
    metrics.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    job = load_config("configs/quickstart.toml", [
        "trainer.mode=sync", "rollout.num_workers=2", f"trainer.steps={NUM_STEPS}",
        "engine.weight_sync=distributed"])  # fmt: skip
    plan = calibrate(run, job, engine_bench=bench, warmup_steps=2, probes=PROBES, fit=False)
    assert plan.weights.sync == "distributed" and plan.weights.push_s == [(2, pytest.approx(0.04))]
    assert plan.trainer.step_s.values == pytest.approx([r["train_s"] - 0.04 for r in recs[:-1]])
    with pytest.raises(ValueError, match="its own push times are used"):
        calibrate(run, job, engine_bench=bench, probes=PROBES, fit=False,
                  weights_bench=_weights_bench(tmp_path))  # fmt: skip


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ('{"benchmark": "weights", "rows": [{"engines": 1, "bytes": 8, "distributed_s": NaN}]}',
         "NaN is not a number"),
        ('{"benchmark": "weights", "rows": [{"engines": 1, "bytes": 8, "distributed_s": 1e400}]}',
         "rows[0].distributed_s = inf: not a finite positive number"),
        ('{"benchmark": "weights", "rows": [{"engines": 1.5, "bytes": 8, "distributed_s": 1}]}',
         "rows[0].engines = 1.5: not a finite positive integer"),
        ('{"benchmark": "weights", "rows": [7]}', "rows[0] is not an object"),
        ('{"benchmark": "weights", "rows": [{"engines": 1, ', "not JSON"),
        ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
        ("[1, 2]", "not a `slipstream bench weights` result"),
        (b"\xff\xfe", "not UTF-8"),
        (None, "not a regular file"),  # a FIFO: reading it would block
    ],
    ids=["nan", "inf", "fractional-engines", "row-not-object", "truncated", "deep", "not-a-result",
         "non-utf8", "fifo"],
)  # fmt: skip
def test_bad_weights_bench_is_one_line_before_anything_runs(body, why, tmp_path: Path, capsys):
    """`plan calibrate --weights-bench FILE` with a file it cannot use: rc 2 and one line naming
    the flag, the file and what is wrong; never a traceback; a FIFO is refused, not read."""
    import os

    from slipstream.cli import main

    path = tmp_path / "weights.json"
    if body is None:
        os.mkfifo(path)
    else:
        path.write_bytes(body if isinstance(body, bytes) else body.encode())
    rc = main(["plan", "calibrate", str(tmp_path), "--weights-bench", str(path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith(f"slipstream: --weights-bench {path}: ") and why in err, err
