"""Block-scaled FP8 weights (DeepSeek-V3/R1, Kimi K2, Qwen3-FP8 releases) dequantised on load.

A quantised checkpoint stores `X.weight` as float8_e4m3fn and beside it `X.weight_scale_inv`
float32 of shape (ceil(rows / 128), ceil(cols / 128)) (config.json `quantization_config`:
`quant_method = "fp8"`, `weight_block_size = [128, 128]`); the value is weight * the scale of its
block. Ragged edges (DeepSeek-V3's kv_a_proj_with_mqa is 576 rows) take the last block's scale.
Equal to transformers' `Fp8Dequantize` / `_dequantize_fp8_weight` (tests/unit/test_mla.py).
Scales stored as E8M0 bytes (uint8, 2^(b - 127)) are read too.
"""

from __future__ import annotations

from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"


def block_size_from_hf(hf_config: dict[str, Any]) -> tuple[int, int] | None:
    """The (rows, cols) block of an FP8 block-quantised checkpoint's config.json, None when it
    is not one; other quantisation methods are refused by name."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"config.json quantization_config.quant_method={method!r}: only block FP8 ('fp8') "
            "checkpoints are dequantised on load"
        )
    block = q.get("weight_block_size") or [128, 128]
    if len(block) != 2:
        raise ValueError(f"config.json quantization_config.weight_block_size={block!r}")
    return int(block[0]), int(block[1])


def dequantize_fp8_block(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """weight (..., rows, cols) FP8 (or any dtype) times the scale of its `block`; the scale
    grid (..., ceil(rows / b0), ceil(cols / b1)). Computed in float32, cast to `dtype`."""
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape[-2:]) != grid:
        raise ValueError(
            f"FP8 weight {tuple(weight.shape)} with {block} blocks needs a scale grid {grid}, "
            f"got {tuple(scale_inv.shape)}"
        )
    s = scale_inv
    s = (s.float() - 127.0).exp2() if s.dtype == torch.uint8 else s.float()
    s = s.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    s = s.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.float() * s).to(dtype)


def infer_block(shape: tuple[int, ...], grid: tuple[int, ...]) -> tuple[int, int]:
    """The block of a weight of `shape` with a scale grid `grid`: 128 along a dim where the
    grid is ceil(n / 128) (the released checkpoints, ragged edges included), else n / grid
    where that divides (other block sizes), else an error."""
    block = []
    for n, g in zip(shape[-2:], grid[-2:], strict=True):
        if -(-n // 128) == g:
            block.append(128)
        elif g and n % g == 0:
            block.append(n // g)
        else:
            raise ValueError(f"FP8 weight {tuple(shape)} does not fit a scale grid {tuple(grid)}")
    return block[0], block[1]


def dequantize_state_dict(
    sd: dict[str, torch.Tensor],
    block: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Every `X` with an `X_scale_inv` beside it dequantised (the scale keys consumed); other
    tensors passed through. `block`: None infers it per tensor from its scale grid
    (`infer_block`). An FP8 tensor without its scale is refused by name."""
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key.endswith(SCALE_SUFFIX):
            if key.removesuffix(SCALE_SUFFIX) not in sd:
                raise ValueError(f"checkpoint has {key} but no {key.removesuffix(SCALE_SUFFIX)}")
            continue
        scale = sd.get(key + SCALE_SUFFIX)
        if scale is not None:
            b = block or infer_block(tuple(value.shape), tuple(scale.shape))
            out[key] = dequantize_fp8_block(value, scale, b, dtype)
        elif value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"checkpoint tensor {key} is FP8 but has no {key}{SCALE_SUFFIX}")
        else:
            out[key] = value
    return out
