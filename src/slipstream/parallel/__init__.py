"""The trainer across several ranks: layout and meshes, FSDP2 + expert-parallel sharding of the
policy, sums over ranks, sharded checkpoints (DCP). See docs/moe-ep.md.

    model, ranks = build_parallel_model(cfg.trainer, checkpoint_dir, device, dtype)

A plain replicated or single-process trainer uses only `Ranks`.
"""

from __future__ import annotations

import torch

from slipstream.config.rl import TrainerConfig
from slipstream.model import MoEForCausalLM
from slipstream.model.layers import Attention
from slipstream.parallel.layout import Layout, Meshes, build_ep_group, build_meshes
from slipstream.parallel.ranks import Ranks
from slipstream.parallel.sharding import build_sharded_model, gather_full_state
from slipstream.runtime import COMPUTE_DTYPES


def build_parallel_model(
    tc: TrainerConfig, checkpoint_dir: str, device: torch.device, dtype: torch.dtype
) -> tuple[MoEForCausalLM, Ranks]:
    """The sharded policy of this rank and its `Ranks` (collective: every rank calls it after
    init_process_group, with the same config)."""
    from slipstream.model import RowReader

    layout = Layout.from_config(tc)
    with RowReader(checkpoint_dir) as reader:
        num_experts = reader.config.num_experts
    meshes = build_meshes(layout, device.type)
    ep_group = build_ep_group(layout, num_experts)
    # bf16/fp16: FSDP2 gathers parameters in the compute dtype, reduces gradients in float32
    param_dtype = None if tc.precision == "fp32" else COMPUTE_DTYPES[tc.precision]
    model = build_sharded_model(checkpoint_dir, layout, meshes, ep_group, tc.ep_dispatcher,
                                device, dtype, param_dtype)  # fmt: skip
    for m in model.modules():
        if isinstance(m, Attention):
            m.fused_inference = False  # see Attention.fused_inference
    return model, Ranks(layout.world, layout.rank, sharded=True, device=device)


__all__ = [
    "Layout",
    "Meshes",
    "Ranks",
    "build_ep_group",
    "build_meshes",
    "build_parallel_model",
    "build_sharded_model",
    "gather_full_state",
]
