"""MXFP4 expert weights (GPT-OSS's released checkpoints), dequantised on load.

A quantised projection `P` is stored as two tensors (OCP Microscaling, FP4 E2M1 elements with a
shared E8M0 scale per 32 values):
- `P_blocks` uint8 (E, R, G, 16): R output rows, each G blocks of 32 values packed two per byte
  (the low nibble is the even element, the high nibble the odd one), each nibble an index into
  the 16 FP4 values below;
- `P_scales` uint8 (E, R, G): a power-of-two exponent per block, biased by 127.
The value of element c of block g in row r is FP4[nibble] * 2^(scale - 127). Rows are the
projection's output features, so dequantised the weight is (E, R, G * 32) = (E, out, in): for
GPT-OSS `gate_up_proj` (E, 2I interleaved, D) and `down_proj` (E, D, I), the transposes of
transformers' in-memory (E, in, out) layout (equal to transformers' `convert_moe_packed_tensors`
after its transpose: tests/unit/test_gpt_oss.py calls it on the same bytes).
"""

from __future__ import annotations

import torch

FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
"""The E2M1 values of the 16 nibbles (sign bit 3)."""
SCALE_BIAS = 127
BLOCK_VALUES = 32


def dequantize(
    blocks_ERGb: torch.Tensor, scales_ERG: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(E, R, G, 16) uint8 blocks and (E, R, G) uint8 scales -> (E, R, G * 32) in `dtype`
    (every FP4 value times a power of two: exact in float32 and bfloat16)."""
    if blocks_ERGb.dtype != torch.uint8 or scales_ERG.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks_ERGb.dtype} and {scales_ERG.dtype}"
        )
    if blocks_ERGb.shape[:-1] != scales_ERG.shape or blocks_ERGb.shape[-1] != BLOCK_VALUES // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks_ERGb.shape)} do not match scales "
            f"{tuple(scales_ERG.shape)} (expected blocks = scales + ({BLOCK_VALUES // 2},))"
        )
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks_ERGb.device)
    lo = lut[(blocks_ERGb & 0x0F).long()]
    hi = lut[(blocks_ERGb >> 4).long()]
    values = torch.stack((lo, hi), dim=-1).flatten(-2)  # (E, R, G, 32): even, odd, ...
    exp = scales_ERG.to(torch.int32) - SCALE_BIAS
    out = torch.ldexp(values, exp[..., None].to(values.device))
    return out.to(dtype).flatten(-2)


def is_quantized_name(name: str) -> bool:
    return name.endswith("_blocks") or name.endswith("_scales")


def dequantize_state_dict(
    sd: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Replace every `P_blocks` / `P_scales` pair with the dequantised (E, out, in) `P` weight
    under the name `P.mxfp4_dequantized` (the family's weight map transposes it into place);
    other tensors pass through. A lone half of a pair is an error naming it."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if not is_quantized_name(name):
            out[name] = t
            continue
        base = name.removesuffix("_blocks").removesuffix("_scales")
        if name.endswith("_scales"):
            if f"{base}_blocks" not in sd:
                raise ValueError(f"MXFP4 {name} has no {base}_blocks")
            continue
        if f"{base}_scales" not in sd:
            raise ValueError(f"MXFP4 {name} has no {base}_scales")
        out[f"{base}.mxfp4_dequantized"] = dequantize(t, sd[f"{base}_scales"], dtype)
    return out
