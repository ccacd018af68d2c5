"""`slipstream bench limits`: what this machine can do for the model, measured, so every
throughput figure can be stated as a fraction of it.

    limits = measure_limits(model_cfg, num_tokens=704, seq_len=11)   # importable API
    limits.train_tokens_per_s_limit, limits.decode_tokens_per_s_limit

Measured in one run, on the torch thread count the job uses (`run.num_threads`, default 1), on
this thread's CPU time when that is 1 thread on CPU (time the OS gives other processes of a
shared host is not counted: the limit is that of a dedicated core), else on wall time:
- matmul FLOP/s at the model's own GEMM shapes (bench/gemms.py): the fused q/k/v and o
  projections, the router, each expert's gate/up and down products at the token count a
  balanced router gives it, the attention products, the LM head; for training each linear in
  its forward, input-gradient and weight-gradient orientation; fp32, and bf16 with `--dtypes`
  (marked emulated when the CPU lacks avx512_bf16/amx_bf16);
- memory bandwidth: a copy and a triad (a = b + s*c) over --bandwidth-mib MiB;
- per-op dispatch overhead: a 1-element add (plain, and recorded by autograd) and a 1x1 mm;
- the optimizer: one fused (else foreach) AdamW step over a flat buffer of the model's
  parameter count (the least an optimizer step over these parameters costs here).
Limits (the figures other benchmarks divide by):
- train tokens/s = num_tokens / (sum of the step's GEMM times + the AdamW step): a trainer with
  no padding, no per-op overhead, perfectly causal attention kernels and fused projections;
- decode tokens/s = batch / max(sum of one decode step's GEMM times, the bytes it must read
  (weights of the projections, router, LM head and the experts a batch touches in expectation,
  plus the KV cache) / triad bandwidth): a roofline of one decode step.
FLOPs per token come from the config (bench/model_flops.py: formula and what it leaves out).
JSON with provenance (load average included) goes to benchmarks/results/limits.json.

Not covered: GPUs other than the device given (CUDA is timed with synchronisation but was never
run here), cache effects between successive GEMMs of a real step (each shape is timed hot),
routing imbalance (experts are assumed balanced), gradient clipping and zero_grad.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from slipstream.bench import model_flops
from slipstream.bench.gemms import Gemm, decode_gemms, decode_read_bytes, time_gemm, train_gemms
from slipstream.config.args import add_config_args

log = logging.getLogger(__name__)


@dataclass
class GemmTiming:
    name: str
    m: int
    k: int
    n: int
    batch: int
    count: float
    """Calls per step (per-expert calls, layers and backward orientations summed)."""
    best_s: float
    """Fastest of the repeats, seconds per call."""
    all_s: list[float]
    flops_per_s: float


@dataclass
class TrainLimit:
    num_tokens: int
    seq_len: float
    flops_per_token: float
    gemm_s: float
    optimizer_s: float
    step_s: float
    tokens_per_s: float
    effective_flops_per_s: float
    """flops_per_token * tokens_per_s: the step's FLOPs over its limit time."""


@dataclass
class DecodeLimit:
    batch: int
    context_len: int
    flops_per_token: float
    gemm_s: float
    read_bytes: float
    memory_s: float
    step_s: float
    tokens_per_s: float
    bound: str
    """"compute" or "memory": which term of the roofline set step_s."""


@dataclass
class Limits:
    device: str
    dtype: str
    num_threads: int
    clock: str
    """"thread CPU time" (1 thread on CPU: immune to a loaded host's scheduling) or "wall"."""
    native_bf16: bool | None
    """Whether the CPU has bf16 matmul instructions (avx512_bf16 / amx_bf16); None on CUDA."""
    copy_bytes_per_s: float
    triad_bytes_per_s: float
    op_overhead_s: dict[str, float]
    optimizer: dict[str, Any]
    train: TrainLimit | None
    decode: DecodeLimit | None
    gemms: dict[str, list[GemmTiming]] = field(default_factory=dict)

    @property
    def train_tokens_per_s_limit(self) -> float:
        if self.train is None:
            raise ValueError("these limits were measured without the train part")
        return self.train.tokens_per_s

    @property
    def decode_tokens_per_s_limit(self) -> float:
        if self.decode is None:
            raise ValueError("these limits were measured without the decode part")
        return self.decode.tokens_per_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def native_bf16_cpu() -> bool:
    """bf16 matmul instructions on this CPU (Linux /proc/cpuinfo flags)."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text(errors="replace") if cpuinfo.is_file() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def pick_clock(device: str) -> Any:
    """The clock measurements read: this thread's CPU time when torch computes on the calling
    thread alone (CPU, 1 intra-op thread), so time the OS gave other processes of a shared host
    is not counted; wall time otherwise (several threads, CUDA)."""
    import torch

    if device == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _best_of(fn: Any, calls: int, repeats: int, device: str) -> list[float]:
    """Seconds per call of `calls` back-to-back calls, `repeats` times (after one warm-up)."""
    clock = pick_clock(device)
    fn()
    _sync(device)
    out = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(calls):
            fn()
        _sync(device)
        out.append((clock() - t0) / calls)
    return out


def measure_bandwidth(num_bytes: int, device: str = "cpu", repeats: int = 3) -> dict[str, float]:
    """Bytes/s of a copy (2 bytes moved per byte) and a triad a = b + 2c (3 per byte), fp32,
    best of `repeats`."""
    import torch

    n = max(1, num_bytes // 4)
    a, b, c = (torch.empty(n, device=device).fill_(1.0) for _ in range(3))
    copy_s = min(_best_of(lambda: a.copy_(b), 3, repeats, device))
    triad_s = min(_best_of(lambda: torch.add(b, c, alpha=2.0, out=a), 3, repeats, device))
    return {"copy_bytes_per_s": 2 * 4 * n / copy_s, "triad_bytes_per_s": 3 * 4 * n / triad_s}


def measure_op_overhead(device: str = "cpu", repeats: int = 3) -> dict[str, float]:
    """Seconds per call of tiny ops: what every kernel launch costs before any arithmetic."""
    import torch

    x, y, out = (torch.ones(1, device=device) for _ in range(3))
    xg = torch.ones(1, device=device, requires_grad=True)
    m1, m2, mo = (torch.ones(1, 1, device=device) for _ in range(3))
    calls = 2000
    return {
        "add_s": min(_best_of(lambda: torch.add(x, y, out=out), calls, repeats, device)),
        "add_autograd_s": min(_best_of(lambda: xg + y, calls, repeats, device)),
        "mm_1x1_s": min(_best_of(lambda: torch.mm(m1, m2, out=mo), calls, repeats, device)),
    }


def measure_optimizer(num_params: int, device: str = "cpu", repeats: int = 3) -> dict[str, Any]:
    """Seconds of one AdamW step over one flat fp32 buffer of num_params parameters (fused where
    this torch supports it on the device, else foreach: the kind is recorded)."""
    import torch

    p = torch.zeros(num_params, device=device, requires_grad=True)
    p.grad = torch.randn(num_params, device=device) * 1e-3
    kind = "fused"
    try:
        opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
        opt.step()
    except RuntimeError as e:  # fused AdamW not built for this device/dtype
        log.warning("bench limits: fused AdamW unavailable (%s); timing foreach AdamW", e)
        kind = "foreach"
        opt = torch.optim.AdamW([p], lr=1e-4, foreach=True)
    times = _best_of(opt.step, 3, repeats, device)
    return {"kind": kind, "num_params": num_params, "step_s": min(times), "all_s": times}


def _timed(gemms: list[Gemm], dtype: Any, device: str, repeats: int) -> list[GemmTiming]:
    """Each product timed at its shape, except "combine" (the gate-weighted sum of the k expert
    outputs: elementwise work, model.moe.combine_topk), counted as a 1 x k @ k x D product per row,
    which is charged at the mean rate of the others instead of the rate a bmm of 1-row matrices
    gets."""
    out, rest = [], []
    for g in gemms:
        if g.name == "combine":
            rest.append(g)
            continue
        times = time_gemm(g, dtype, device, repeats=repeats, clock=pick_clock(device))
        best = min(times)
        out.append(GemmTiming(g.name, g.m, g.k, g.n, g.batch, g.count, best, times,
                              g.flops_per_call / best))  # fmt: skip
    flops = sum(t.count * 2 * t.batch * t.m * t.k * t.n for t in out)
    rate = flops / max(1e-12, sum(t.count * t.best_s for t in out))
    for g in rest:
        best = g.flops_per_call / rate
        out.append(GemmTiming(g.name, g.m, g.k, g.n, g.batch, g.count, best, [best], rate))
    return out


def measure_limits(
    model_cfg: Any,
    *,
    num_tokens: int = 704,
    seq_len: float = 11.0,
    decode_batch: int = 64,
    context_len: int = 32,
    parts: tuple[str, ...] = ("train", "decode"),
    dtype: str = "float32",
    device: str = "cpu",
    num_threads: int | None = None,
    bandwidth_bytes: int = 256 << 20,
    repeats: int = 3,
) -> Limits:
    """This machine's limits for `model_cfg` (a ModelConfig with vocab_size set): a training
    step of `num_tokens` positions in sequences of `seq_len`, and a decode step of
    `decode_batch` rows at `context_len`. `num_threads` (None: leave torch's setting) applies
    while measuring and is restored after. See the module docstring for what is measured."""
    import torch

    if model_cfg.vocab_size <= 0:
        raise ValueError("model_cfg.vocab_size is 0: resolve it from the task's tokenizer first")
    unknown = set(parts) - {"train", "decode"}
    if unknown:
        raise ValueError(f"parts {sorted(unknown)} unknown; expected train and/or decode")
    torch_dtype = getattr(torch, dtype)
    before = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        bw = measure_bandwidth(bandwidth_bytes, device, repeats)
        overhead = measure_op_overhead(device, repeats)
        gemms: dict[str, list[GemmTiming]] = {}
        train = decode = None
        optimizer: dict[str, Any] = {}
        if "train" in parts:
            gemms["train"] = _timed(train_gemms(model_cfg, num_tokens, seq_len), torch_dtype,
                                    device, repeats)  # fmt: skip
            optimizer = measure_optimizer(model_flops.num_params(model_cfg), device, repeats)
            gemm_s = sum(t.count * t.best_s for t in gemms["train"])
            step_s = gemm_s + optimizer["step_s"]
            fpt = model_flops.train_flops_per_token(model_cfg, seq_len)
            train = TrainLimit(num_tokens, seq_len, fpt, gemm_s, optimizer["step_s"], step_s,
                               num_tokens / step_s, fpt * num_tokens / step_s)  # fmt: skip
        if "decode" in parts:
            gemms["decode"] = _timed(decode_gemms(model_cfg, decode_batch, context_len),
                                     torch_dtype, device, repeats)  # fmt: skip
            gemm_s = sum(t.count * t.best_s for t in gemms["decode"])
            nbytes = decode_read_bytes(model_cfg, decode_batch, context_len,
                                       torch.finfo(torch_dtype).bits // 8)  # fmt: skip
            memory_s = nbytes / bw["triad_bytes_per_s"]
            step_s = max(gemm_s, memory_s)
            decode = DecodeLimit(decode_batch, context_len,
                                 model_flops.decode_flops_per_token(model_cfg, context_len),
                                 gemm_s, nbytes, memory_s, step_s, decode_batch / step_s,
                                 "compute" if gemm_s >= memory_s else "memory")  # fmt: skip
        clock = "thread CPU time" if pick_clock(device) is time.thread_time else "wall"
        return Limits(device=device, dtype=dtype, num_threads=torch.get_num_threads(), clock=clock,
                      native_bf16=None if device.startswith("cuda") else native_bf16_cpu(),
                      copy_bytes_per_s=bw["copy_bytes_per_s"],
                      triad_bytes_per_s=bw["triad_bytes_per_s"], op_overhead_s=overhead,
                      optimizer=optimizer, train=train, decode=decode, gemms=gemms)  # fmt: skip
    finally:
        torch.set_num_threads(before)


def resolve_vocab(model_cfg: Any, task_cfg: Any) -> Any:
    """The model config with vocab_size taken from the task's tokenizer when it is 0."""
    if model_cfg.vocab_size > 0:
        return model_cfg
    from slipstream.tasks import get_taskset

    vocab = get_taskset(task_cfg).tokenizer.vocab_size
    return model_cfg.model_copy(update={"vocab_size": vocab})


def fraction_line(name: str, figure: float, limit: float, unit: str) -> str:
    """One printed line: figure, limit and the fraction (what other benchmarks print)."""
    return f"{name}: {figure:,.0f} {unit} = {figure / limit:.1%} of the limit {limit:,.0f} {unit}"


# ---- CLI ---------------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("limits", help="this machine's matmul FLOP/s at the model's GEMM shapes, "
                       "bandwidth, op overhead; train/decode tokens/s limits",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_config_args(p)
    p.add_argument("--models", default="config",
                   help="comma list: config (the -c model) and/or larger (bench engine's)")  # fmt: skip
    p.add_argument("--seq-len", type=float, default=11.0, help="positions per trained sequence")
    p.add_argument("--sequences", type=int, default=0,
                   help="sequences per train step (0: groups_per_step x group_size)")  # fmt: skip
    p.add_argument("--decode-batch", type=int, default=0, help="0: engine.max_batch_size")
    p.add_argument("--context", type=int, default=32, help="decode context length")
    p.add_argument("--dtypes", default="auto", help="comma list; auto: float32, plus bfloat16 "
                   "where the CPU has bf16 matmul instructions (or on CUDA)")  # fmt: skip
    p.add_argument("--threads", type=int, default=0, help="0: run.num_threads, else torch's")
    p.add_argument("--device", default="cpu")
    p.add_argument("--bandwidth-mib", type=int, default=256)
    p.add_argument("--out", default="benchmarks/results/limits.json", help="JSON output path")
    p.set_defaults(func=run)


def model_configs(cfg: Any, names: str) -> dict[str, Any]:
    """name -> ModelConfig (vocab resolved): "config" is cfg.model, "larger" bench engine's."""
    from slipstream.bench.models import MODELS

    out = {}
    base = resolve_vocab(cfg.model, cfg.task)
    for name in names.split(","):
        if name == "config":
            out[name] = base
        elif name in MODELS:
            # validated (model_copy(update=) is not): nested keys such as rope_scaling
            out[name] = type(base).model_validate({**base.model_dump(), **MODELS[name]})
        else:
            raise ValueError(
                f"--models: {name!r} unknown; expected config or one of {list(MODELS)}"
            )
    return out


def run(args: argparse.Namespace) -> int:
    from slipstream.config import load_config
    from slipstream.observe.provenance import collect_provenance, write_result

    cfg = load_config(args.config, args.overrides)
    threads = args.threads or cfg.run.num_threads or None
    sequences = args.sequences or cfg.trainer.groups_per_step * cfg.rollout.group_size
    num_tokens = int(round(sequences * args.seq_len))
    batch = args.decode_batch or cfg.engine.max_batch_size
    dtypes = args.dtypes.split(",")
    if args.dtypes == "auto":
        native = args.device.startswith("cuda") or native_bf16_cpu()
        dtypes = ["float32", "bfloat16"] if native else ["float32"]
    load_start = os.getloadavg()
    results = []
    for name, mcfg in model_configs(cfg, args.models).items():
        for dtype in dtypes:
            lim = measure_limits(mcfg, num_tokens=num_tokens, seq_len=args.seq_len,
                                 decode_batch=batch, context_len=args.context, dtype=dtype,
                                 device=args.device, num_threads=threads,
                                 bandwidth_bytes=args.bandwidth_mib << 20)  # fmt: skip
            results.append({"model": name, "model_config": mcfg.model_dump(), **lim.to_dict()})
            _print(name, mcfg, lim)
    record = {
        "benchmark": "limits",
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "results": results,
        "provenance": collect_provenance({"loadavg_start": load_start,
                                          "loadavg_end": os.getloadavg()}),
    }  # fmt: skip
    out = write_result(args.out, record)
    print(f"load average {load_start[0]:.1f} -> {os.getloadavg()[0]:.1f}\nwrote {out}")
    return 0


def _print(name: str, mcfg: Any, lim: Limits) -> None:
    bf16 = "" if lim.dtype != "bfloat16" or lim.native_bf16 is not False else " (emulated)"
    print(f"\n== {name} ({model_flops.num_params(mcfg) / 1e6:.2f}M params, "
          f"{model_flops.num_params(mcfg, active=True) / 1e6:.2f}M active), {lim.dtype}{bf16}, "
          f"{lim.num_threads} thread(s), {lim.device}, {lim.clock}")  # fmt: skip
    print(f"{'GEMM':<22} {'batch x m x k x n':>22} {'calls/step':>10} {'GFLOP/s':>8} "
          f"{'range':>13} {'ms/step':>8}")  # fmt: skip
    for phase, timings in lim.gemms.items():
        for t in timings:
            lo = 2 * t.batch * t.m * t.k * t.n / max(t.all_s) / 1e9
            shape = f"{t.batch} x {t.m} x {t.k} x {t.n}"
            print(f"{phase[:1]} {t.name:<20} {shape:>22} {t.count:>10.1f} "
                  f"{t.flops_per_s / 1e9:>8.1f} {f'{lo:.1f}-{t.flops_per_s / 1e9:.1f}':>13} "
                  f"{1e3 * t.count * t.best_s:>8.2f}")  # fmt: skip
    o = lim.op_overhead_s
    print(f"bandwidth: copy {lim.copy_bytes_per_s / 1e9:.1f} GB/s, triad "
          f"{lim.triad_bytes_per_s / 1e9:.1f} GB/s | op overhead: add {1e6 * o['add_s']:.1f} us, "
          f"add+autograd {1e6 * o['add_autograd_s']:.1f} us, mm 1x1 {1e6 * o['mm_1x1_s']:.1f} us")  # fmt: skip
    if lim.train is not None:
        t = lim.train
        print(f"train limit: {t.tokens_per_s:,.0f} tokens/s ({t.num_tokens} tokens/step of "
              f"seq {t.seq_len:g}: GEMMs {1e3 * t.gemm_s:.1f} ms + AdamW "
              f"({lim.optimizer['kind']}) {1e3 * t.optimizer_s:.1f} ms; "
              f"{t.flops_per_token / 1e6:.2f} MFLOP/token fwd+bwd, "
              f"{t.effective_flops_per_s / 1e9:.1f} GFLOP/s)")  # fmt: skip
    if lim.decode is not None:
        d = lim.decode
        print(f"decode limit: {d.tokens_per_s:,.0f} tokens/s (batch {d.batch}, context "
              f"{d.context_len}: GEMMs {1e3 * d.gemm_s:.2f} ms, reads {d.read_bytes / 2**20:.1f} "
              f"MiB = {1e3 * d.memory_s:.2f} ms -> {d.bound}-bound; "
              f"{d.flops_per_token / 1e6:.2f} MFLOP/token)")  # fmt: skip
