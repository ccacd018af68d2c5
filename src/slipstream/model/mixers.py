"""The token mixers other than model/layers.py's `Attention`, chosen per layer from `ModelConfig`:
Gated DeltaNet for `linear_attention` layers (model/gated_deltanet.py), multi-head latent
attention when `kv_lora_rank` > 0 (model/mla.py), gated attention when `attention_output_gate`
(model/gated_attention.py); and the adapter that runs them inside the decoder's forward.

These mixers compute on the (B, T, D) layout. In a packed training forward (`Packing`: the real
tokens of right-padded rows laid end to end) the adapter scatters the M rows back to (B, T) with
zeros at the padding, runs the mixer, and gathers the real rows: exact, since each row's real
tokens are a prefix and every mixer is causal (attention masks the later padding, the GDN
recurrence and its conv only run forward). The RoPE tables come packed too; they are scattered
back the same way (with rotate-half's sign taken out of sin again).

Decoding through a cache: attention-like mixers (MLA, gated attention) hand their q/k/v to
`KVCache.attend` like `Attention`; MLA's V is narrower than its K, so its cache must take V of
another width (the engine's `SlotKVCache` does). A Gated DeltaNet layer has no KV: it runs
through a `RecurrentStateCache`, which holds each sequence's `GDNState` (conv window and
recurrent state, fixed size) and calls the layer on the right states
(`RecurrentStateCache.linear_mix`); the engine's `SlotKVCache` is one. A GDN layer given a
`KVCache` that holds no recurrent state raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from slipstream.config.model import ModelConfig
from slipstream.model.attention import KVCache
from slipstream.model.gated_attention import GatedAttention
from slipstream.model.gated_deltanet import GatedDeltaNet, GDNState
from slipstream.model.layers import Packing
from slipstream.model.mla import MLAttention, mla_softmax_scale

Mixer = GatedDeltaNet | MLAttention | GatedAttention


@runtime_checkable
class RecurrentStateCache(Protocol):
    """A cache that also holds the Gated DeltaNet layers' per-sequence state (see the module
    docstring). `linear_mix(layer_idx, mixer, x_BTD)` runs `mixer(x, state)` over the new
    tokens x (B, T, D) of this forward, each row or segment on its own sequence's state
    (`GatedDeltaNet.forward` continues from it and writes the new state back in place), and
    returns the outputs (B, T, D) in x's order."""

    def linear_mix(
        self,
        layer_idx: int,
        mixer: Callable[[torch.Tensor, GDNState], torch.Tensor],
        x_BTD: torch.Tensor,
    ) -> torch.Tensor: ...


def is_linear_layer(cfg: ModelConfig, layer_idx: int) -> bool:
    """Layer `layer_idx` is a Gated DeltaNet (`linear_attention`) layer."""
    return bool(cfg.layer_types) and cfg.layer_types[layer_idx] == "linear_attention"


def build_mixer(cfg: ModelConfig, layer_idx: int) -> Mixer | None:
    """The layer's token mixer when it is not the plain `Attention` (None then)."""
    if is_linear_layer(cfg, layer_idx):
        return GatedDeltaNet(
            cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
            cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim,
            cfg.rms_norm_eps, layer_idx,
        )  # fmt: skip
    if cfg.kv_lora_rank:
        yarn = cfg.rope_scaling
        scale = mla_softmax_scale(
            cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
            None if yarn is None else yarn.factor,
            (yarn.mscale_all_dim or 0.0) if yarn is not None else 0.0,
        )
        return MLAttention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
            cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, scale,
            cfg.rope_interleave, layer_idx, cfg.attention_bias,
        )  # fmt: skip
    if cfg.attention_output_gate:
        return GatedAttention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.rms_norm_eps, layer_idx, cfg.attention_bias,
        )  # fmt: skip
    return None


def run_mixer(
    mixer: nn.Module,
    x: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    cache: KVCache | None,
    packing: Packing | None,
) -> torch.Tensor:
    """The mixer on x (B, T, D), or on x (M, D) with `packing` (see the module docstring)."""
    if isinstance(mixer, GatedDeltaNet) and cache is not None:
        if not isinstance(cache, RecurrentStateCache) or packing is not None:
            raise NotImplementedError(
                f"layer {mixer.layer_idx} is a Gated DeltaNet layer: decoding it needs a cache "
                f"that holds its recurrent state (a RecurrentStateCache, e.g. the engine's "
                f"SlotKVCache), not {type(cache).__name__}"
            )
        return cache.linear_mix(mixer.layer_idx, mixer, x)
    if packing is None:
        if isinstance(mixer, GatedDeltaNet):
            return mixer(x)
        return mixer(x, cos_sin, cache)
    B, T = packing.batch_size, packing.num_tokens
    x_BTD = packing.unpack(x).view(B, T, -1)
    if isinstance(mixer, GatedDeltaNet):
        out_BTD = mixer(x_BTD)
    else:
        cos_M1R, sin_signed_M1R = cos_sin  # model/layers.py packed_rope_tables
        s1, s2 = sin_signed_M1R[:, 0].chunk(2, dim=-1)
        cos_BTR = packing.unpack(cos_M1R[:, 0]).view(B, T, -1)
        sin_BTR = packing.unpack(torch.cat((-s1, s2), dim=-1)).view(B, T, -1)
        out_BTD = mixer(x_BTD, (cos_BTR, sin_BTR), cache)
    return packing.pack(out_BTD.reshape(B * T, -1))
