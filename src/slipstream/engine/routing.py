"""Recording MoE routing during the engine's forwards, and its SGLang wire format.

The model exposes its routing through `SparseMoeBlock.routing_sink` (model/moe_block.py): when set, the
block calls it with the top-k expert ids (N, k) it routed every token of the forward with, the
very tensor its experts then use, so what is recorded is what was computed (no recomputation,
no change to the forward's numerics). The engine sets the sinks only for forwards in which some
row asked for routing; otherwise the blocks see None and do nothing.

Wire format (SGLang, `return_routed_experts`; python/sglang/srt/layers/moe/
routed_experts_capturer.py and tokenizer_manager): `meta_info["routed_experts"]` is base64 of a
little-endian int32 C-order array of shape (prompt + completion - 1, num_hidden_layers, k), one
row per input position. SGLang indexes layers by their id in the whole model; slipstream's
server writes -1 in the rows of dense (non-MoE) layers, SGLang leaves them unspecified, so a
client that knows the model's config selects the MoE layers (`decode_routed_experts`).

Legend: N tokens of a forward, L MoE layers (model order), k experts per token, R rows
(input positions), H all hidden layers.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from slipstream.model.moe_block import SparseMoeBlock


def routing_dtype(num_experts: int) -> torch.dtype:
    """uint8 when expert ids fit (num_experts <= 256), else int16."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 2**15:
        return torch.int16
    raise ValueError(f"num_experts={num_experts} does not fit int16 expert ids")


class RoutingRecorder:
    """The model's MoE blocks in model order, and a context that records their routing."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.num_layers = len(self.blocks)
        self.k = self.blocks[0].top_k if self.blocks else 0
        num_experts = self.blocks[0].experts.num_experts if self.blocks else 1
        self.dtype = routing_dtype(num_experts)

    @contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """Within the block, every MoE block appends its ids (N, k) of each forward to the
        yielded list (so one forward appends L tensors, in layer order)."""
        ids: list[torch.Tensor] = []
        for block in self.blocks:
            block.routing_sink = ids.append
        try:
            yield ids
        finally:
            for block in self.blocks:
                block.routing_sink = None

    def stack(self, ids: list[torch.Tensor]) -> torch.Tensor:
        """The L captured (N, k) tensors of one forward as (N, L, k) in the compact dtype."""
        if len(ids) != self.num_layers:
            raise RuntimeError(
                f"routing capture saw {len(ids)} MoE forwards, expected {self.num_layers}"
            )
        return torch.stack(ids, dim=1).to(self.dtype)


def encode_routed_experts(
    routed_RLk: torch.Tensor, moe_layer_ids: list[int], num_hidden_layers: int
) -> str:
    """SGLang's `meta_info["routed_experts"]`: base64 of int32 (R, H, k), -1 in dense layers."""
    rows, _, k = routed_RLk.shape
    full_RHk = np.full((rows, num_hidden_layers, k), -1, dtype="<i4")
    full_RHk[:, moe_layer_ids, :] = routed_RLk.to(torch.int32).numpy()
    return base64.b64encode(full_RHk.tobytes()).decode("ascii")


def decode_routed_experts(
    data: str,
    num_rows: int,
    num_hidden_layers: int,
    k: int,
    moe_layer_ids: list[int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Inverse of `encode_routed_experts` (and SGLang's format): (R, L, k) of the MoE layers,
    in `dtype`. ValueError when the payload does not have R * H * k int32 values or holds ids
    outside the dtype's range in a MoE layer."""
    raw = base64.b64decode(data.encode("ascii"), validate=True)
    expected = num_rows * num_hidden_layers * k * 4
    if len(raw) != expected:
        raise ValueError(
            f"routed_experts: {len(raw)} bytes, expected {expected} "
            f"({num_rows} rows x {num_hidden_layers} layers x top-{k} x int32)"
        )
    full_RHk = np.frombuffer(raw, dtype="<i4").reshape(num_rows, num_hidden_layers, k)
    moe_RLk = torch.from_numpy(full_RHk[:, moe_layer_ids, :].copy())
    high = 255 if dtype == torch.uint8 else 2**15 - 1
    if moe_RLk.numel() and (int(moe_RLk.min()) < 0 or int(moe_RLk.max()) > high):
        raise ValueError(f"routed_experts: expert ids outside [0, {high}] in a MoE layer")
    return moe_RLk.to(dtype)
