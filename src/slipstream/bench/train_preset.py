"""`slipstream bench train --preset NAME [--device cuda]`: the trainer at a GPU-scale shape
(bench/models.py GPU_PRESETS: `mid`, `qwen3-30b-a3b-4l`; `tiny` for CPU tests).

One step = the real `Trainer.step` (forward, GRPO loss through the chunked LM head, backward,
clip, fused AdamW) on `--batch` random sequences of `--seq-len` positions (no padding), float32
master weights, `--precision` compute (default bf16 on CUDA, fp32 on CPU). Printed and written
next to each other, measured in the same run on the same device:
- tokens/s (median over --steps timed steps after --warmup), and peak memory (CUDA: the
  allocator's peak over the timed steps);
- MFU: model FLOPs per token (bench/model_flops.py: 6 x active matmul parameters + causal
  attention) x tokens/s over the device's matmul peak in the compute dtype, the fastest of
  `bench limits`' GEMM timings of this shape's training GEMMs plus one 8192^3 (CUDA) / 1024^3
  (CPU) square GEMM;
- transformers' `Qwen3MoeForCausalLM` on the same weights (converted, bench/../checkpoint.py)
  and batch: forward + cross-entropy + backward + fused AdamW under the same autocast; and the
  ratio. Without transformers installed that row says so (null in the JSON).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step: Any, device: Any, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _peak_flops(model_cfg: Any, tokens: int, seq_len: int, dtype: str, device: str) -> dict:
    """The fastest matmul rate measured here in `dtype` (bench limits' GEMMs of this shape, and
    one large square GEMM)."""
    import torch

    from slipstream.bench.gemms import Gemm, time_gemm
    from slipstream.bench.limits import measure_limits

    lim = measure_limits(model_cfg, num_tokens=tokens, seq_len=seq_len, parts=("train",),
                         dtype=dtype, device=device, bandwidth_bytes=64 << 20)  # fmt: skip
    best = max(lim.gemms["train"], key=lambda t: t.flops_per_s)
    n = 8192 if device.startswith("cuda") else 1024
    square = Gemm("square", n, n, n)
    square_flops_s = square.flops_per_call / min(time_gemm(square, getattr(torch, dtype), device))
    peak = max(best.flops_per_s, square_flops_s)
    return {"peak_flops_per_s": peak, "best_model_gemm": best.name,
            "best_model_gemm_flops_per_s": best.flops_per_s,
            "square_gemm_n": n, "square_gemm_flops_per_s": square_flops_s,
            "train_limit_tokens_per_s": lim.train_tokens_per_s_limit}  # fmt: skip


def _hf_step(model: Any, batch_ids: Any, compute_dtype: Any, device: Any) -> Any:
    """transformers' Qwen3MoeForCausalLM with `model`'s weights, and one training step of it."""
    import torch
    import transformers

    from slipstream.model.checkpoint import hf_config_from_model_config

    # our parameter names and layouts are transformers-5's in-memory ones (stacked experts)
    sd = model.state_dict()
    config = hf_config_from_model_config(model.config, torch.float32)
    hf_cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in config.items()
                                            if k not in ("architectures", "model_type")})  # fmt: skip
    with torch.device(device):
        hf = transformers.Qwen3MoeForCausalLM(hf_cfg)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if unexpected or [k for k in missing if "rotary" not in k]:
        raise RuntimeError(f"HF weights do not fit: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")  # fmt: skip
    hf.train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-6, fused=device.type in ("cpu", "cuda"))
    autocast = torch.autocast(device.type, dtype=compute_dtype,
                              enabled=compute_dtype != torch.float32)  # fmt: skip

    def step() -> None:
        with autocast:
            out = hf(input_ids=batch_ids, labels=batch_ids)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()

    return step


def run_preset(args: argparse.Namespace) -> int:
    import torch

    from slipstream.bench import model_flops
    from slipstream.bench.models import GPU_PRESETS
    from slipstream.config.model import ModelConfig
    from slipstream.config.rl import TrainerConfig
    from slipstream.model import MoEForCausalLM
    from slipstream.model.moe_block import fallbacks
    from slipstream.observe.provenance import collect_provenance, write_result
    from slipstream.rl.trainer import Trainer
    from slipstream.rl.types import Batch, Group, Sample, TaskRef
    from slipstream.runtime import COMPUTE_DTYPES

    if args.preset not in GPU_PRESETS:
        raise ValueError(f"--preset: {args.preset!r} unknown; expected one of {list(GPU_PRESETS)}")
    device = torch.device(args.device)
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    compute_dtype = COMPUTE_DTYPES[precision]
    B, T = args.batch, args.seq_len
    cfg = ModelConfig(**{**GPU_PRESETS[args.preset],
                         "max_position_embeddings": max(T + 1, 8)})  # fmt: skip
    load_start = os.getloadavg()
    torch.manual_seed(0)
    with torch.device(device):
        model = MoEForCausalLM(cfg)
    tcfg = TrainerConfig(lr=1e-6, precision=precision, skip_no_signal=False,
                         activation_checkpointing=args.activation_checkpointing,
                         compile_blocks=args.compile_blocks)  # fmt: skip
    trainer = Trainer(model, tcfg, pad_id=0, device=device)
    g = torch.Generator().manual_seed(1)
    ids_BT = torch.randint(1, cfg.vocab_size, (B, T + 1), generator=g)
    prompt = T // 4
    samples = [Sample(row[:prompt].tolist(), row[prompt:].tolist(), [-1.0] * (T + 1 - prompt),
                      [0] * (T + 1 - prompt), reward=float(i % 2))
               for i, row in enumerate(ids_BT)]  # fmt: skip
    batch = Batch(groups=[Group(task=TaskRef(0, 0), samples=samples)], trainer_version=0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = _timed(lambda: trainer.step(batch), device, args.warmup, args.steps)
    peak_mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    tokens = B * T
    tok_s = tokens / statistics.median(times)
    fpt = model_flops.train_flops_per_token(cfg, T)
    peak = _peak_flops(cfg, tokens, T, str(compute_dtype).removeprefix("torch."), args.device)
    mfu = fpt * tok_s / peak["peak_flops_per_s"]
    hf_row: dict[str, Any] = {"tokens_per_s": None, "reason": None}
    if args.hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            hf_row["reason"] = "transformers is not installed (pip install -e '.[hf]')"
        else:
            del trainer  # its optimizer state
            hf_step = _hf_step(model, ids_BT[:, :T].to(device), compute_dtype, device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            hf_times = _timed(hf_step, device, args.warmup, args.steps)
            hf_row["tokens_per_s"] = tokens / statistics.median(hf_times)
            hf_row["peak_memory_bytes"] = (torch.cuda.max_memory_allocated(device)
                                           if device.type == "cuda" else None)  # fmt: skip
    result = {
        "preset": args.preset, "model_config": cfg.model_dump(), "device": str(device),
        "precision": precision, "batch": B, "seq_len": T, "tokens_per_step": tokens,
        "step_s": times, "tokens_per_s": tok_s, "train_flops_per_token": fpt,
        "mfu": mfu, "peak": peak, "peak_memory_bytes": peak_mem,
        "params": model_flops.num_params(cfg), "active_params": model_flops.num_params(cfg, active=True),
        "hf": hf_row,
        "vs_hf": None if not hf_row["tokens_per_s"] else tok_s / hf_row["tokens_per_s"],
        "moe_fallbacks": list(fallbacks),
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, {
        "benchmark": "train-preset",
        "metric": "trainer tokens/s (forward + backward + AdamW), MFU vs the measured matmul peak",
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "results": [result],
        "provenance": collect_provenance({"loadavg_start": load_start,
                                          "loadavg_end": os.getloadavg()}),
    })  # fmt: skip
    mem = "-" if peak_mem is None else f"{peak_mem / 2**30:.1f} GiB"
    print(
        f"bench train --preset {args.preset} on {device} ({precision}, {B} x {T} tokens, "
        f"{result['params'] / 1e6:,.1f}M params, {result['active_params'] / 1e6:,.1f}M active)"
    )
    print(
        f"  slipstream:   {tok_s:,.0f} tokens/s, MFU {mfu:.1%} of "
        f"{peak['peak_flops_per_s'] / 1e9:,.0f} GFLOP/s ({compute_dtype} matmul peak measured "
        f"here), peak memory {mem}"
    )
    if hf_row["tokens_per_s"]:
        print(
            f"  transformers: {hf_row['tokens_per_s']:,.0f} tokens/s (same weights and batch);"
            f" slipstream {result['vs_hf']:.2f}x"
        )
    else:
        print(f"  transformers: not run ({hf_row['reason'] or '--no-hf'})")
    if fallbacks:
        print(f"  MoE fallbacks taken: {fallbacks}")
    print(f"load average {load_start[0]:.1f} -> {os.getloadavg()[0]:.1f}\nwrote {out}")
    return 0
