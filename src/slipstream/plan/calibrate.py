"""`slipstream plan calibrate RUN_DIR`: a rates file from a finished run's own measurements.

Read from the run (what it measured of itself, so host load affects every number alike):

- `metrics.jsonl`: per-step `train_s` (trainer step + weight publish; replayed in order as the
  step times), the per-step loop overhead (elapsed - idle - train), and the per-step mean
  completion length, whose spread across steps gives the spread of a group's length;
- the rollout workers' final stats (`launch/logs/w*.log`, the worker's `exiting 0: {...}` line):
  summed request latency `generate_s` over requests (the engine's submit -> completion time of a
  group), completion tokens per sample, verification time per sample;
- the job config (`-c FILE` + overrides, as the run was started): batch shape, staleness bound,
  worker settings, engine KV slots, injected verifier latency.

Read from elsewhere, because the run does not log them: the engine's step-time curve (fixed +
per-token cost) from a `slipstream bench engine` JSON for the same model (its native-engine
points: step_s / decode_steps at the mean decode batch); per-version weight fetch/apply from a
probe on the run's last published safetensors file (numpy + hashlib doing the worker's read,
hash and two copies); coordinator RPC round trips from a probe (a `multiprocessing.managers`
server in another process, called with this process idle and with a busy Python thread).

Fit: one factor, `rollout.engine.slowdown`, multiplies the engine's step time; it is chosen so
that the simulated mean request latency equals the run's (fixed-point iterations of the
simulator). The probes are used as measured (they run under the host's load of the moment). Nothing trainer-side is fitted, and the predicted
figures (samples/s, idle fraction, the trainer's waits) are never inputs.

Assumptions: the samples of a group have the same length (true for short answers whose length
the prompt fixes; per-sample lengths are not logged); prompts are BOS + `a op b =` for the
arithmetic task, 16 tokens otherwise.

Not covered: runs without worker logs (give `request_latency_s`), engines other than the native
one (an HTTP engine's request latency includes the server's queue), dynamic sampling.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from slipstream.config.base import ConfigError
from slipstream.plan.dists import Dist, dist_mean
from slipstream.plan.rates import (
    CalibrationInfo,
    EngineRates,
    LoopRates,
    PlanConfig,
    RolloutRates,
    TrainerRates,
    VerifierRates,
    WeightRates,
)
from slipstream.plan.results import figures_from_metrics
from slipstream.rl.coordinator import connect

log = logging.getLogger(__name__)

_EXIT_RE = re.compile(r"exiting \d+: (\{.*\})\s*$")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (is this a finished run's directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_worker_stats(run_dir: Path) -> list[dict[str, float]]:
    """Final stats dict of every rollout worker incarnation (its log's `exiting` line)."""
    out = []
    for log in sorted((run_dir / "launch" / "logs").glob("w*.log")):
        for line in reversed(log.read_text(errors="replace").splitlines()):
            m = _EXIT_RE.search(line)
            if m:
                out.append({k: float(v) for k, v in ast.literal_eval(m.group(1)).items()})
                break
    return out


def engine_curve(bench_json: Path, model: dict[str, int]) -> tuple[float, float, str]:
    """(step_fixed_s, step_per_token_s, description) fitted to a bench-engine JSON's native
    points for the model with the same hidden size, layers, experts and top-k."""
    data = read_bench_json(bench_json, "--engine-bench")
    if not isinstance(data, dict):
        raise PlanInputError(f"--engine-bench {bench_json}: not a `slipstream bench engine` result")
    keys = ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok")
    pts = []
    for r in data.get("results", []):
        mc = r.get("model_config", {})
        if all(mc.get(k) == model.get(k) for k in keys):
            st = r["native"]["engine_stats"]
            pts.append((st["decode_rows"] / st["decode_steps"], st["step_s"] / st["decode_steps"]))
    if len(pts) < 2 or len({round(b, 3) for b, _ in pts}) < 2:
        raise ValueError(
            f"{bench_json} has {len(pts)} native-engine point(s) for a model with "
            f"{ {k: model.get(k) for k in keys} }; need two batch sizes (run `slipstream bench "
            "engine` with that model and two workloads)"
        )
    b = np.array([p[0] for p in pts])
    s = np.array([p[1] for p in pts])
    slope, intercept = np.polyfit(b, s, 1)
    slope, intercept = max(float(slope), 0.0), max(float(intercept), 0.0)
    desc = (f"{bench_json.name}: native engine " + ", ".join(f"{x:.1f} rows {y * 1e3:.2f} ms"
            for x, y in pts) + f" -> {intercept * 1e3:.2f} ms + {slope * 1e6:.1f} us/token")  # fmt: skip
    return intercept, slope, desc


def probe_weight_load(weights_dir: Path, repeats: int = 21) -> tuple[float, float]:
    """(fetch_s, apply_s) of the latest version under `<store>/weights`, done the way the worker
    does it but with numpy instead of torch: fetch = read the safetensors file, sha256 it (the
    manifest check) and deserialise every tensor (one copy); apply = copy every tensor again
    (into the engine's parameters)."""
    versions = sorted(p for p in weights_dir.glob("v*") if (p / "manifest.json").is_file())
    if not versions:
        raise FileNotFoundError(f"no published weight version under {weights_dir}")
    path = versions[-1] / "model.safetensors"
    fetch, apply = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        raw = path.read_bytes()
        hashlib.sha256(raw).hexdigest()
        header_len = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + header_len])
        base = 8 + header_len
        tensors = [
            np.frombuffer(raw, dtype=np.uint8, count=m["data_offsets"][1] - m["data_offsets"][0],
                          offset=base + m["data_offsets"][0]).copy()
            for name, m in header.items() if name != "__metadata__"
        ]  # fmt: skip
        t1 = time.perf_counter()
        for t in tensors:
            t.copy()
        t2 = time.perf_counter()
        fetch.append(t1 - t0)
        apply.append(t2 - t1)
    return float(np.median(fetch)), float(np.median(apply))


# The coordinator's own transport (rl/coordinator.py `serve`), serving a real Coordinator from
# another process, as the trainer process serves it to the workers.
_COORDINATOR_SERVER = """
import threading
from slipstream.rl.buffer import ExperienceBuffer
from slipstream.rl.coordinator import Coordinator, serve
from slipstream.rl.queue import TaskQueue
host, port = serve(Coordinator(TaskQueue(1), ExperienceBuffer(1, 0)), b"plan-probe")
print(port, flush=True)
threading.Event().wait()  # serve until killed
"""


def _busy_python(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(2000):
            x += i * i


def probe_rpc(num_calls: int = 200, repeats: int = 3) -> tuple[float, float]:
    """(idle_s, busy_s): mean round trip of a coordinator call (`version()` through
    `rl.coordinator.connect`'s proxy) to a Coordinator that `rl.coordinator.serve` serves from
    another process over loopback TCP, with the calling process otherwise idle, and while another
    of its threads runs Python code (as a worker's engine thread does between forwards: both
    contend for the interpreter lock). Means, not
    medians: the lock hand-over (5 ms switch interval) makes the distribution bimodal and the
    mean is what adds up; the median of `repeats` such means, because on a shared host one
    burst of other work can multiply a single mean several times."""
    proc = subprocess.Popen([sys.executable, "-c", _COORDINATOR_SERVER], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            proc.kill()
            raise RuntimeError(f"coordinator probe server did not start (exit {proc.wait()})")
        proxy = connect(("127.0.0.1", int(line)), b"plan-probe")

        def mean_round_trip() -> float:
            times = []
            for _ in range(num_calls):
                t0 = time.perf_counter()
                proxy.version()
                times.append(time.perf_counter() - t0)
                time.sleep(0.001)
            return float(np.mean(times))

        idle = float(np.median([mean_round_trip() for _ in range(repeats)]))
        stop = threading.Event()
        busy_thread = threading.Thread(target=_busy_python, args=(stop,), daemon=True)
        busy_thread.start()
        busy = float(np.median([mean_round_trip() for _ in range(repeats)]))
        stop.set()
        busy_thread.join()
    finally:
        proc.kill()
        proc.wait()
    return idle, busy


def discrete_lengths(mean: float, sd: float, n: int = 200) -> list[float]:
    """n integer lengths with the given mean and standard deviation: on {m-1, m, m+1} (m the
    nearest integer) when that can hold the spread, else rounded normal quantiles."""
    m = round(mean)
    d = mean - m
    var = sd * sd
    p_hi, p_lo = (var + d * d + d) / 2, (var + d * d - d) / 2
    if p_hi >= 0 and p_lo >= 0 and p_hi + p_lo <= 1:
        n_hi, n_lo = round(p_hi * n), round(p_lo * n)
        return [float(m + 1)] * n_hi + [float(m - 1)] * n_lo + [float(m)] * (n - n_hi - n_lo)
    z = [statistics.NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]
    v = [max(1, round(mean + sd * x)) for x in z]
    # rounding moved the mean: step single values by one token until it is back
    deficit = round(mean * n) - sum(v)
    order = range(n) if deficit > 0 else range(n - 1, -1, -1)
    for i in order:
        if deficit == 0:
            break
        if deficit > 0:
            v[i], deficit = v[i] + 1, deficit - 1
        elif v[i] > 1:
            v[i], deficit = v[i] - 1, deficit + 1
    return [float(x) for x in v]


# The worker's own weight update, timed in a subprocess (the planner must not import torch):
# WeightStore.fetch (read, manifest hashes, deserialise) and the native engine's update_weights
# (apply at the idle engine's next step boundary), on the run's last published version. The
# engine comes from the factory; `stats` (step counters) is the native engine's own.
_ENGINE_LOAD_PROBE = """
import json, statistics, sys, tempfile, time
import torch
torch.set_num_threads(1)
from slipstream.config.engine import EngineConfig
from slipstream.engine.base import GenerateRequest, SamplingParams
from slipstream.engine import build_engine
from slipstream.model import load_pretrained
from slipstream.storage.weights import WeightStore
store = WeightStore(sys.argv[1], 3)
version = max(store.versions())
with tempfile.TemporaryDirectory() as tmp:
    model = load_pretrained(store.fetch_to_dir(version, tmp))
engine = build_engine(EngineConfig(type="native"), model, version=0)
def request():  # one GRPO-shaped request: 8 samples of 4 tokens (no EOS: no tokenizer)
    return GenerateRequest(list(range(3, 10)), SamplingParams(n=8, max_new_tokens=4, seed=0))
engine.generate([request()])
print("ready", flush=True)
sys.stdin.readline()  # start together with the other probes (workers load every version at once)
fetch, apply, steps, rows, step_s = [], [], 0, 0, 0.0
for i in range(int(sys.argv[2])):
    t0 = time.perf_counter()
    sd = store.fetch(version)
    t1 = time.perf_counter()
    engine.update_weights(version + 1 + i, sd)
    fetch.append(t1 - t0)
    apply.append(time.perf_counter() - t1)
    before = dict(engine.stats)  # the engine's speed now, to compare with the run's
    engine.generate([request()])
    steps += engine.stats["decode_steps"] - before["decode_steps"]
    rows += engine.stats["decode_rows"] - before["decode_rows"]
    step_s += engine.stats["step_s"] - before["step_s"]
    time.sleep(0.05)
engine.close()
print(json.dumps({"fetch_s": statistics.median(fetch), "apply_s": statistics.median(apply),
                  "step_s": step_s / steps, "batch_rows": rows / steps}))
"""


def probe_engine_weight_load(
    store_dir: Path, num_concurrent: int = 1, repeats: int = 7, pythonpath: str | None = None
) -> dict[str, float]:
    """(fetch_s, apply_s) of the real worker path (see _ENGINE_LOAD_PROBE), in `num_concurrent`
    processes started together, as the run's workers all load each version at about the same
    time; means over the processes of their medians. Also returns the engine's step time and mean
    batch measured between the loads (how fast the host runs the engine at probe time).
    `pythonpath` puts another source tree first (the code the run used). Raises RuntimeError
    (with the probe's output) if a probe fails."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ENGINE_LOAD_PROBE, str(store_dir), str(repeats)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for _ in range(num_concurrent)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"weight-load probe did not start: {p.communicate()[1][-2000:]}")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            if p.returncode != 0:
                raise RuntimeError(f"weight-load probe exited {p.returncode}: {err[-2000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return {k: float(np.mean([r[k] for r in results]))
            for k in ("fetch_s", "apply_s", "step_s", "batch_rows")}  # fmt: skip


def version_bytes(weights_dir: Path) -> int:
    """Bytes of the tensors of the newest version under `<store>/weights` (its safetensors
    header's data offsets; nothing is read but the header)."""
    versions = sorted(p for p in weights_dir.glob("v*") if (p / "manifest.json").is_file())
    if not versions:
        raise FileNotFoundError(f"no published weight version under {weights_dir}")
    total = 0
    for path in sorted(versions[-1].glob("*.safetensors")):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(m["data_offsets"][1] - m["data_offsets"][0]
                     for k, m in header.items() if k != "__metadata__")  # fmt: skip
    return total


class PlanInputError(ConfigError):
    """An input file of `plan calibrate` (a bench JSON) that cannot be used: one line naming the
    file and what is wrong (the CLI prints it as a config error, rc 2)."""


MAX_BENCH_JSON_BYTES = 64 << 20  # a bench result is kilobytes


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def read_bench_json(path: str | Path, what: str) -> Any:
    """A bench result file: a regular file (a FIFO would block the read), at most
    MAX_BENCH_JSON_BYTES, UTF-8 JSON without NaN/Infinity and not nested past the parser's
    depth; else PlanInputError naming `what` and the path."""
    path = Path(path)
    where = f"{what} {path}"
    if not path.exists():
        raise PlanInputError(f"{where}: no such file")
    if not path.is_file():
        raise PlanInputError(f"{where}: not a regular file")
    if path.stat().st_size > MAX_BENCH_JSON_BYTES:
        raise PlanInputError(f"{where}: larger than {MAX_BENCH_JSON_BYTES >> 20} MiB")
    try:
        text = path.read_bytes().decode("utf-8")
        return json.loads(text, parse_constant=_refuse_constant)
    except UnicodeDecodeError as e:
        raise PlanInputError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise PlanInputError(f"{where}: not JSON ({e.msg} at line {e.lineno} column {e.colno})"
                             ) from None  # fmt: skip
    except RecursionError:
        raise PlanInputError(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # _refuse_constant
        raise PlanInputError(f"{where}: {e}") from None


def read_weights_bench(bench_json: str | Path) -> list[tuple[int, float, int]]:
    """The (engines, distributed_s, bytes) rows of a `slipstream bench weights` JSON, sorted by
    engines; PlanInputError for anything else (engines a positive integer, seconds and bytes
    finite and positive)."""
    what = "--weights-bench"
    record = read_bench_json(bench_json, what)
    if (
        not isinstance(record, dict)
        or record.get("benchmark") != "weights"
        or not record.get("rows")
    ):
        raise PlanInputError(
            f"{what} {bench_json}: not a `slipstream bench weights` result (no rows)"
        )
    rows = record["rows"]
    if not isinstance(rows, list):
        raise PlanInputError(f"{what} {bench_json}: rows is not a list")
    out = []
    for i, r in enumerate(rows):
        try:
            engines, push_s, nbytes = r["engines"], r["distributed_s"], r["bytes"]
        except (KeyError, TypeError):
            raise PlanInputError(f"{what} {bench_json}: rows[{i}] is not an object with engines, "
                                 "distributed_s and bytes") from None  # fmt: skip
        for name, v, integral in (("engines", engines, True), ("distributed_s", push_s, False),
                                  ("bytes", nbytes, True)):  # fmt: skip
            number = isinstance(v, int | float) and not isinstance(v, bool)
            if not (number and math.isfinite(v) and v > 0 and (not integral or v == int(v))):
                raise PlanInputError(f"{what} {bench_json}: rows[{i}].{name} = {str(v)[:40]}: "
                                     f"not a finite positive {'integer' if integral else 'number'}")  # fmt: skip
        out.append((int(engines), float(push_s), int(nbytes)))
    return sorted(out)


def weights_from_bench(bench_json: Path, run_version_bytes: int, store_every: int) -> WeightRates:
    """`[weights]` for pushed versions from a `slipstream bench weights` JSON: its
    (engines, distributed_s) rows as the push times, scaled to the run's version bytes."""
    rows = read_weights_bench(bench_json)
    return WeightRates(sync="distributed", push_s=[(e, t) for e, t, _ in rows],
                       push_bytes=rows[0][2], version_bytes=run_version_bytes,
                       store_every=store_every)  # fmt: skip


def run_probes(
    run_dir: Path, num_workers: int = 1, pythonpath: str | None = None, rpc_calls: int = 200
) -> dict[str, Any]:
    """The weight and RPC probes for a run: the worker's real weight update in `num_workers`
    concurrent processes (falling back, with a warning, to the numpy imitation when the engine
    code cannot run here), and the RPC round trips."""
    store = Path(run_dir) / "store"
    out: dict[str, Any] = {"weight_probe": "engine", "weight_probe_processes": num_workers}
    try:
        eng = probe_engine_weight_load(store, num_workers, pythonpath=pythonpath)
        out.update(weight_fetch_s=eng["fetch_s"], weight_apply_s=eng["apply_s"],
                   probe_engine_step_s=eng["step_s"], probe_engine_batch_rows=eng["batch_rows"])  # fmt: skip
    except (RuntimeError, OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        log.warning("weight-load probe through the engine failed (%s); using the numpy "
                    "imitation, which underestimates the apply", str(e).splitlines()[0])  # fmt: skip
        out["weight_fetch_s"], out["weight_apply_s"] = probe_weight_load(store / "weights")
        out["weight_probe"] = "numpy"
    out["rpc_idle_s"], out["rpc_busy_s"] = probe_rpc(rpc_calls)
    return out


def group_length_spread(
    records: list[dict[str, Any]], group_size: int, groups: int, warmup: int
) -> float:
    """Standard deviation of a group's completion length implied by the spread of the per-step
    mean lengths (a step's mean is the average of `groups` group means: var(step) =
    var(group) / groups), assuming the samples of one group have the same length."""
    means = [r["completion_len_mean"] for r in records if "completion_len_mean" in r][warmup:]
    if len(means) < 3:
        return 0.0
    return float(np.std(means) * math.sqrt(groups))


def prompt_tokens_estimate(job: Any) -> int:
    """Prompt tokens per group: BOS + `a op b =` for the arithmetic task (char tokenizer), 16
    otherwise (an assumption: the run does not log prompt lengths)."""
    if job.task.name == "arithmetic":
        return 2 * job.task.max_digits + 3
    return 16


def calibrate(
    run_dir: str | Path,
    job: Any,
    *,
    engine_bench: str | Path,
    warmup_steps: int = 1,
    request_latency_s: float | None = None,
    fit: bool = True,
    probes: dict[str, Any] | None = None,
    weights_bench: str | Path | None = None,
) -> PlanConfig:
    """Rates for the run in `run_dir`, started with the job config `job` (a SlipstreamConfig).
    `probes`: results of `run_probes(run_dir)` taken earlier (e.g. right after the run); None =
    probe now. Weights: a run with `engine.weight_sync = "distributed"` gives its own push
    times (per step `weight_served_s_max`, taken out of its `train_s` so the simulator adds the
    push back at the live instance count); `weights_bench` (a `slipstream bench weights` JSON)
    plans a store run's job with pushed weights at the bench's measured push times, scaled to
    the run's version bytes."""
    run_dir = Path(run_dir)
    if weights_bench is not None:
        read_weights_bench(weights_bench)  # a bad file fails first, naming itself
    records = read_metrics(run_dir / "metrics.jsonl")
    fig = figures_from_metrics(records, warmup_steps)
    steps = [r for r in records if "train_s" in r]
    train = [float(r["train_s"]) for r in steps]  # in order: step i of the sim replays step i
    stats = read_worker_stats(run_dir)
    notes: list[str] = []
    measured: dict[str, float] = dict(fig)
    if request_latency_s is None:
        if not stats:
            raise ValueError(
                f"no rollout worker stats in {run_dir}/launch/logs (the workers' `exiting` "
                "line); give the mean request latency yourself"
            )
        requests = sum(s["groups_acked"] + s["groups_rejected"] for s in stats)
        request_latency_s = sum(s["generate_s"] for s in stats) / max(1.0, requests)
        tokens = sum(s["tokens"] for s in stats) / max(1.0, sum(s["samples"] for s in stats))
        verify_s = sum(s["verify_s"] for s in stats) / max(1.0, sum(s["samples"] for s in stats))
        measured.update(request_latency_s=request_latency_s, completion_tokens_mean=tokens,
                        weight_updates=sum(s["weight_updates"] for s in stats),
                        requests=requests)  # fmt: skip
    else:
        tokens, verify_s = fig["completion_len_mean"], 0.0
    ro_cfg, eng_cfg = job.rollout, job.engine
    fixed_s, per_token_s, curve = engine_curve(Path(engine_bench), job.model.model_dump())
    probes = probes or run_probes(run_dir, job.rollout.num_workers)
    fetch_s, apply_s = probes["weight_fetch_s"], probes["weight_apply_s"]
    rpc_idle_s, rpc_busy_s = probes["rpc_idle_s"], probes["rpc_busy_s"]
    groups = job.trainer.groups_per_step
    length_sd = group_length_spread(records, ro_cfg.group_size, groups, warmup_steps)
    measured.update(probe_weight_fetch_s=fetch_s, probe_weight_apply_s=apply_s,
                    probe_rpc_idle_s=rpc_idle_s, probe_rpc_busy_s=rpc_busy_s,
                    group_length_sd_tokens=length_sd)  # fmt: skip
    slot_len = eng_cfg.max_seq_len or job.model.max_position_embeddings
    latency = Dist(kind="fixed", value=verify_s)
    if ro_cfg.verify_latency == "lognormal":
        # The worker's verify_s includes the injected delay; the task's own verifier (a string
        # compare for arithmetic) is what is left over, and is ~0 next to the delay.
        latency = Dist(kind="lognormal", p50=ro_cfg.verify_latency_p50_s,
                       p99_over_p50=ro_cfg.verify_latency_p99_over_p50)  # fmt: skip
        notes.append(f"verifier: injected lognormal (p50 {ro_cfg.verify_latency_p50_s} s, p99/p50 "
                     f"{ro_cfg.verify_latency_p99_over_p50}, mean {dist_mean(latency):.3f} s); "
                     f"measured verify time per sample {verify_s:.3f} s")  # fmt: skip
    else:
        notes.append(f"verifier: in-process, measured {verify_s * 1e6:.1f} us per sample")
    max_staleness = job.buffer.max_staleness
    plan = PlanConfig(
        name=run_dir.name,
        description=f"calibrated from the run in {run_dir}",
        loop=LoopRates(groups_per_step=job.trainer.groups_per_step, group_size=ro_cfg.group_size,
                       mode=job.trainer.mode, max_staleness=max_staleness, steps=len(steps),
                       warmup_steps=warmup_steps, partial_rollouts=ro_cfg.partial_rollouts),
        trainer=TrainerRates(step_s=Dist(kind="empirical", values=train, order="sequential"),
                             overhead_s=fig["overhead_s_mean"]),
        rollout=RolloutRates(
            num_instances=ro_cfg.num_workers, max_inflight_tasks=ro_cfg.max_inflight_tasks,
            max_scoring_tasks=ro_cfg.max_scoring_tasks,
            tasks_per_lease=ro_cfg.tasks_per_lease, lease_ttl_s=ro_cfg.lease_ttl_s,
            weight_poll_s=ro_cfg.weight_poll_s, lease_rpc_s=rpc_idle_s, ack_rpc_s=rpc_idle_s,
            rpc_busy_s=rpc_busy_s,
            engine=EngineRates(
                step_fixed_s=fixed_s, step_per_token_s=per_token_s,
                max_batch_rows=min(eng_cfg.max_batch_size, eng_cfg.kv_cache_tokens // slot_len),
                prompt_tokens=prompt_tokens_estimate(job),
                completion_tokens=Dist(kind="empirical",
                                       values=discrete_lengths(tokens, length_sd)),
                length_per="group",
                max_new_tokens=ro_cfg.max_new_tokens or eng_cfg.max_new_tokens,
                weight_fetch_s=fetch_s, weight_apply_s=apply_s,
            ),
        ),
        verifier=VerifierRates(latency_s=latency, concurrency_per_instance=ro_cfg.verify_threads),
    )  # fmt: skip
    notes += [
        f"trainer step: the run's {len(train)} train_s values replayed in order (mean "
        f"{np.mean(train) * 1e3:.1f} ms); loop overhead {fig['overhead_s_mean'] * 1e3:.2f} ms",
        f"engine curve: {curve}",
        f"request latency (generate_s / requests, worker logs): {request_latency_s * 1e3:.2f} ms",
        f"completion tokens per sample {tokens:.3f}; per group (shared by its samples) sd "
        f"{length_sd:.3f} from the per-step means",
        f"probes: weight fetch {fetch_s * 1e3:.2f} ms, apply {apply_s * 1e3:.2f} ms "
        f"({probes.get('weight_probe', 'given')} probe, {probes.get('weight_probe_processes', 1)} "
        f"at once); RPC "
        f"{rpc_idle_s * 1e3:.3f} ms idle, {rpc_busy_s * 1e3:.3f} ms with a busy Python thread",
        f"prompt tokens {plan.rollout.engine.prompt_tokens} (estimated from the task config)",
    ]
    if "probe_engine_step_s" in probes:  # how slow the host ran the engine at probe time
        measured["probe_slowdown"] = probes["probe_engine_step_s"] / (
            fixed_s + per_token_s * probes["probe_engine_batch_rows"]
        )
    _calibrate_weights(plan, run_dir, job, steps, weights_bench, notes, measured)
    if job.buffer.dynamic_sampling:
        # every dropped group is generated and never trained: the simulator, which does not
        # drop them, predicts more samples/s than such a run makes (+60% on the quickstart)
        notes.append("WARNING: the run used buffer.dynamic_sampling, which the simulator does "
                     "not model (dropped groups are generated, never trained): its samples/s "
                     "will be overstated; calibrate a run with --buffer.dynamic_sampling=false")  # fmt: skip
        log.warning(notes[-1])
    if fit:
        plan, k, fit_lat = fit_slowdown(plan, request_latency_s)
        measured.update(fitted_slowdown=k, fitted_request_latency_s=fit_lat)
        notes.append(f"fitted slowdown {k:.3f} (simulated request latency {fit_lat * 1e3:.2f} ms)")
        if "probe_slowdown" in measured:
            notes.append(f"engine slowdown at probe time {measured['probe_slowdown']:.3f} "
                         "(recorded only: weight and RPC probes are used as measured)")  # fmt: skip
    plan.calibration = CalibrationInfo(source=str(run_dir), notes=notes, measured=measured)
    return plan


def _calibrate_weights(plan: PlanConfig, run_dir: Path, job: Any, steps: list[dict[str, Any]],
                       weights_bench: str | Path | None, notes: list[str],
                       measured: dict[str, float]) -> None:  # fmt: skip
    """`plan.weights` (and the step times of a pushing run) as `calibrate`'s docstring says."""
    if job.engine.weight_sync not in ("store", "distributed"):
        raise ValueError(f"engine.weight_sync = {job.engine.weight_sync!r}: the planner models "
                         "'store' and 'distributed'")  # fmt: skip
    if job.engine.weight_sync == "store" and weights_bench is None:
        return
    nbytes = version_bytes(run_dir / "store" / "weights")
    every = job.engine.weight_store_every
    if job.engine.weight_sync == "distributed":
        if weights_bench is not None:
            raise ValueError("the run pushed its weights (engine.weight_sync = 'distributed'): "
                             "its own push times are used; --weights-bench is for a store run")  # fmt: skip
        served = [float(r.get("weight_served_s_max", 0.0)) for r in steps]
        pushed = [x for x in served if x > 0]
        if not pushed:
            raise ValueError(f"{run_dir}/metrics.jsonl has no weight_served_s_max: no push "
                             "reached an engine in this run")  # fmt: skip
        # the mean, not the median: every step pays its push, and the pushes' tail (a push
        # that met a busy engine) is part of what the trainer paid (the median missed ~9% of
        # the samples/s of the quickstart's trainer-bound runs: docs/plan.md)
        push_s = sum(pushed) / len(pushed)
        step_s = plan.trainer.step_s  # the run's train_s, replayed in order
        step_s.values = [max(1e-6, t - x) for t, x in zip(step_s.values, served, strict=True)]
        plan.weights = WeightRates(sync="distributed", push_s=[(job.rollout.num_workers, push_s)],
                                   push_bytes=nbytes, store_every=every)  # fmt: skip
        measured.update(push_s_mean=push_s, version_bytes=float(nbytes))
        notes.append(f"weights pushed (distributed): mean publish -> served {push_s * 1e3:.1f} "
                     f"ms to {job.rollout.num_workers} engines ({nbytes / 1e6:.2f} MB per "
                     "version), taken out of each step's train_s; store copies stay inside it")  # fmt: skip
        return
    plan.weights = weights_from_bench(Path(weights_bench), nbytes, every)  # type: ignore[arg-type]
    w = plan.weights
    ratio = w.push_bytes / nbytes
    if not 0.5 <= ratio <= 2.0:
        # per-request and per-tensor costs do not scale with bytes: on the 2-vCPU EPYC the
        # quickstart's 7.2 MB push ran at 0.15 GB/s and mid's 1.83 GB at 0.94 GB/s
        notes.append(f"WARNING: the bench pushed {ratio:.3g}x this run's bytes per version; its "
                     "times are scaled by bytes, but a push's per-request and per-tensor costs "
                     "are not: bench the job's own shape for a faithful figure")  # fmt: skip
        log.warning(notes[-1])
    notes.append(f"weights pushed (what-if, from {weights_bench}): push "
                 + ", ".join(f"{t:.3f} s at {n} engines" for n, t in w.push_s)
                 + f" for {w.push_bytes / 1e9:.3f} GB, scaled to this run's {nbytes / 1e6:.2f} MB "
                 "per version; store copies every "
                 f"{every}-th version not modelled (store_write_s 0)")  # fmt: skip


def fit_slowdown(
    plan: PlanConfig, request_latency_s: float, *, iterations: int = 8, tolerance: float = 0.005
) -> tuple[PlanConfig, float, float]:
    """Find the slowdown k at which the simulated mean request latency matches the measured one
    (fixed point k <- k * measured / simulated). Returns (plan with k, k, simulated latency)."""
    from slipstream.plan.sim import Simulator

    k = plan.rollout.engine.slowdown
    sim_lat = float("nan")
    for _ in range(iterations):
        trial = plan.model_copy(deep=True)
        trial.rollout.engine.slowdown = k
        sim_lat = Simulator(trial).run().mean_request_latency_s
        plan = trial
        ratio = request_latency_s / sim_lat
        if abs(ratio - 1) < tolerance:
            break
        k *= ratio
    return plan, plan.rollout.engine.slowdown, sim_lat
