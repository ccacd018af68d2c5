"""The decoder-only MoE language model (Qwen3-MoE architecture), parameter names identical to
transformers' `Qwen3MoeForCausalLM` (transformers-5 in-memory layout: stacked experts).

Shape legend: B batch, T tokens, D hidden_size, V vocab, E experts, N = B*T, M real tokens of a
packed batch (`skip_padding_BT`), L MoE layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

from slipstream.config.model import ModelConfig
from slipstream.model.attention import KVCache
from slipstream.model.gated_deltanet import GatedDeltaNet, ZeroCenteredRMSNorm
from slipstream.model.layers import (
    MLP,
    Attention,
    Packing,
    RMSNorm,
    packed_rope_tables,
    rope_cos_sin,
)
from slipstream.model.mixers import Mixer, build_mixer, run_mixer
from slipstream.model.moe_block import Experts, SparseMoeBlock, router_losses


@dataclass
class ModelOutput:
    logits_BTV: torch.Tensor | None
    """Next-token logits, always float32; None when the forward was asked for `hidden` instead."""
    aux_loss: torch.Tensor
    """router_aux_loss_coef * load_balance + router_z_loss_coef * z_loss (scalar, float32, part of
    the graph when a coefficient is not 0); 0 when the model has no MoE layer."""
    router_logits: tuple[torch.Tensor, ...] | None = None
    """Per MoE layer, router logits (B*T, E) in the model dtype (0 at the padding when the
    forward skipped it); None without MoE layers."""
    load_balance_loss: torch.Tensor | None = None
    """Unweighted load-balancing loss, detached (for logging); None without MoE layers."""
    z_loss: torch.Tensor | None = None
    """Unweighted router z-loss, detached (for logging); None without MoE layers."""
    hidden: torch.Tensor | None = None
    """With `return_hidden`: the final-norm hidden states the LM head would read, (B*T, D), or
    (M, D) for the real tokens `rows_M` of a packed forward (model/lm_loss.py takes them)."""
    rows_M: torch.Tensor | None = None
    """With `return_hidden` and `skip_padding_BT`: which of the B*T positions `hidden` holds."""


def is_moe_layer(cfg: ModelConfig, layer_idx: int) -> bool:
    """Same rule as transformers: not in mlp_only_layers and (idx+1) % decoder_sparse_step == 0."""
    return (
        layer_idx not in cfg.mlp_only_layers
        and cfg.num_experts > 0
        and (layer_idx + 1) % cfg.decoder_sparse_step == 0
    )


def rotary_dim(cfg: ModelConfig) -> int:
    """Dims of each head RoPE rotates: head_dim * partial_rotary_factor (as transformers: int())."""
    return int(cfg.head_dim * cfg.partial_rotary_factor)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        # a Gated DeltaNet (`linear_attn`), MLA or gated attention layer (model/mixers.py), or
        # the plain Attention below
        mixer = build_mixer(cfg, layer_idx)
        self.plain_attention = mixer is None
        """self_attn is model/layers.py's Attention (else a model/mixers.py mixer)."""
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: Attention | Mixer
        if isinstance(mixer, GatedDeltaNet):
            self.linear_attn = mixer
        elif mixer is not None:
            self.self_attn = mixer
        else:
            self.self_attn = Attention(
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                cfg.rms_norm_eps,
                layer_idx,
                qkv_bias=cfg.attention_bias,
                out_bias=cfg.attention_out_bias,
                qk_norm=cfg.qk_norm,
                clip_qkv=cfg.clip_qkv,
                rotary_dim=rotary_dim(cfg),
                sinks=cfg.attention_sinks,
                sliding_window=cfg.layer_window(layer_idx),
            )
        self.mlp: SparseMoeBlock | MLP
        if is_moe_layer(cfg, layer_idx):
            # on the default expert path; model/converters.py's ExpertPath applies moe_impl
            self.mlp = SparseMoeBlock.from_config(cfg)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = decoder_norm(cfg)
        self.post_attention_layernorm = decoder_norm(cfg)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None,
        replay_ids_Nk: torch.Tensor | None = None,
        packing: Packing | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, D), or (M, D) with `packing`; -> (x after the layer, router logits or None)."""
        h = self.input_layernorm(x_BTD)
        if self.linear_attn is not None:
            x_BTD = x_BTD + run_mixer(self.linear_attn, h, cos_sin, cache, packing)
        elif self.plain_attention:
            x_BTD = x_BTD + self.self_attn(h, cos_sin, cache, packing)
        else:
            x_BTD = x_BTD + run_mixer(self.self_attn, h, cos_sin, cache, packing)
        h = self.post_attention_layernorm(x_BTD)
        if isinstance(self.mlp, SparseMoeBlock):
            out, router_logits = self.mlp(h, replay_ids_Nk)
            return x_BTD + out, router_logits
        return x_BTD + self.mlp(h), None


class Backbone(nn.Module):
    """`model.*` in HF naming: embed_tokens, layers, norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = decoder_norm(cfg)


def decoder_norm(cfg: ModelConfig) -> RMSNorm | ZeroCenteredRMSNorm:
    """The residual-stream RMSNorm: zero-centred `1 + w` (Qwen3-Next / 3.5) or plain."""
    if cfg.norm_zero_centered:
        return ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_in_float32)


class MoEForCausalLM(nn.Module):
    """Qwen3-MoE causal LM. Built in float32 on the current default device with a random init
    (std `initializer_range`); use `.to(device, dtype)` or `load_pretrained` for weights.

    `gradient_checkpointing = True` recomputes each decoder layer in backward (training without a
    cache only). Runtime choices of the config (`moe_impl`, activation checkpointing, compile) are
    not read here: model/converters.py applies them to the built model."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (>0) before building the model")
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={cfg.num_attention_heads} not divisible by "
                f"num_key_value_heads={cfg.num_key_value_heads}"
            )
        if cfg.head_dim % 2:
            raise ValueError(f"head_dim={cfg.head_dim} must be even for RoPE")
        self.config = cfg.model_copy(deep=True)  # the model's own: the caller's may change
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.gradient_checkpointing = False
        self.router_stats_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Data-parallel training sets this to a sum over ranks, so the router losses are those
        of the whole batch (`load_balancing_loss`); None: this process's tokens only."""
        self.moe_layer_ids = [i for i in range(cfg.num_hidden_layers) if is_moe_layer(cfg, i)]
        self.hf_passthrough: dict[str, torch.Tensor] = {}
        """Checkpoint tensors the family keeps without building them (e.g. GLM's MTP layers):
        set by `load_hf_state_dict`, written back by `save_pretrained` (model/families/)."""
        if self.lm_head.weight.device.type != "meta":
            self.init_weights()
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head with embed_tokens when `tie_word_embeddings` (call after loading)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                m.weight.normal_(0.0, std)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, Experts):
                m.gate_up_proj.normal_(0.0, std)
                m.down_proj.normal_(0.0, std)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
            elif isinstance(m, GatedDeltaNet | ZeroCenteredRMSNorm):
                m.reset_parameters()
            if isinstance(m, Attention) and m.sinks is not None:
                m.sinks.normal_(0.0, std)  # as transformers' GPT-OSS init

    def default_position_ids(
        self, batch_size: int, num_tokens: int, cache: KVCache | None, device: torch.device
    ) -> torch.Tensor:
        """arange(T), offset by the positions the cache holds (`KVCache.length`: an int, a
        per-row (B,) tensor, or None for a cache whose callers always pass positions)."""
        pos_BT = torch.arange(num_tokens, device=device)[None].expand(batch_size, -1)
        length = None if cache is None else cache.length
        if isinstance(length, int):
            pos_BT = pos_BT + length
        elif isinstance(length, torch.Tensor):
            pos_BT = pos_BT + length.to(device=device, dtype=torch.long).reshape(-1, 1)
        return pos_BT

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        position_ids_BT: torch.Tensor | None = None,
        cache: KVCache | None = None,
        token_mask_BT: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        replay_routing_LNk: torch.Tensor | None = None,
        skip_padding_BT: torch.Tensor | None = None,
        num_real: int | None = None,
        return_hidden: bool = False,
    ) -> ModelOutput:
        """Logits for every input position. Without a cache: causal attention over the T tokens
        given (no padding mask: right-pad batches). With a cache: see `KVCache`.
        `token_mask_BT` (optional, bool) only excludes tokens from the router losses, which are
        not computed (aux_loss = 0) for cached forwards under torch.no_grad / inference_mode.
        `logits_to_keep` > 0 returns logits for the last that many positions only (saves the
        (B, T, V) projection at prefill); 0 keeps all.
        `replay_routing_LNk` (routing replay): per MoE layer (model order), the experts each of
        the N = B*T tokens (row-major) is routed to instead of the router's own top-k (see
        `SparseMoeBlock.route`); the router losses still follow the live router.
        `skip_padding_BT` (bool, training without a cache): the real tokens of a right-padded
        batch, a prefix of every row (checked). Every per-token layer (embedding, norms,
        projections, RoPE, experts, head) then runs on these M tokens only (`Packing`; ~30% of
        the positions of the quickstart's RL batches are padding); attention scatters them to
        (B, T) for its kernel. The real positions get the same values as without it (the
        rounding of the weight gradients may differ, since their sums run over M rows instead of
        N); the padding gets logits 0 and router logits 0, and is left out of the router losses
        whatever `token_mask_BT` says there. Only for experts in this process (the
        expert-parallel dispatchers need the same token count on every rank). `num_real`: the
        count of real tokens in `skip_padding_BT` if the caller knows it on the host (then the
        packing costs no host sync; `Packing.from_mask`). `return_hidden` (training, no cache):
        skip the LM head and return the final-norm hidden states (`ModelOutput.hidden`), for a
        loss that never materialises the (B, T, V) logits (model/lm_loss.py)."""
        B, T = input_ids_BT.shape
        if replay_routing_LNk is not None and replay_routing_LNk.shape[:2] != (
            len(self.moe_layer_ids),
            B * T,
        ):
            raise ValueError(
                f"replay_routing_LNk has shape {tuple(replay_routing_LNk.shape)}; expected "
                f"({len(self.moe_layer_ids)} MoE layers, {B * T} tokens, top-k)"
            )
        if position_ids_BT is None:
            position_ids_BT = self.default_position_ids(B, T, cache, input_ids_BT.device)
        packing = None
        if skip_padding_BT is not None:
            if cache is not None or logits_to_keep > 0:
                raise ValueError("skip_padding_BT is for training forwards: no cache, all logits")
            packing = Packing.from_mask(skip_padding_BT, num_real)
            input_ids = packing.pack(input_ids_BT.reshape(-1))  # (M,)
            position_ids = packing.pack(position_ids_BT.reshape(-1))
            if replay_routing_LNk is not None:
                replay_routing_LNk = replay_routing_LNk.index_select(1, packing.rows_M)
        else:
            input_ids, position_ids = input_ids_BT, position_ids_BT
        x_BTD = self.model.embed_tokens(input_ids)  # (M, D) when packed
        cos_sin = rope_cos_sin(position_ids, rotary_dim(self.config), self.config.rope_theta,
                               x_BTD.dtype, self.config.rope_scaling)  # fmt: skip
        if packing is not None:
            cos_sin = packed_rope_tables(*cos_sin)
        router_logits: list[torch.Tensor] = []
        checkpoint = self.gradient_checkpointing and self.training and cache is None
        for layer in self.model.layers:
            replay = None
            if replay_routing_LNk is not None and isinstance(layer.mlp, SparseMoeBlock):
                replay = replay_routing_LNk[len(router_logits)]
            if checkpoint:
                x_BTD, rl = torch.utils.checkpoint.checkpoint(
                    layer, x_BTD, cos_sin, None, replay, packing, use_reentrant=False
                )
            else:
                x_BTD, rl = layer(x_BTD, cos_sin, cache, replay, packing)
            if rl is not None:
                router_logits.append(rl)
        if logits_to_keep > 0:
            x_BTD = x_BTD[:, -logits_to_keep:]
        hidden = rows_M = logits_BTV = None
        if return_hidden:
            if cache is not None or logits_to_keep > 0:
                raise ValueError("return_hidden is for training forwards: no cache, all positions")
            hidden = self.model.norm(x_BTD)
            hidden = hidden if packing is not None else hidden.reshape(B * T, -1)
            rows_M = None if packing is None else packing.rows_M
        else:
            logits_BTV = self.lm_head(self.model.norm(x_BTD)).float()
            if packing is not None:
                logits_BTV = packing.unpack(logits_BTV).view(B, T, -1)
        device = input_ids_BT.device
        # Router losses are a training signal: skip them for cached inference without autograd
        # (the engine's decode loop), where they cost ~10% of a small model's step for nothing.
        if not router_logits or (cache is not None and not torch.is_grad_enabled()):
            zero = torch.zeros((), device=device)
            return ModelOutput(logits_BTV, zero, tuple(router_logits) or None, hidden=hidden,
                               rows_M=rows_M)  # fmt: skip
        cfg = self.config
        mask_N = None if token_mask_BT is None else token_mask_BT.reshape(-1)
        if packing is not None and mask_N is not None:
            mask_N = packing.pack(mask_N)  # the router logits are the M real tokens'
        # with both coefficients 0 (GLM-4.5, DeepSeek-V3) the losses are statistics only: no
        # graph, so backward does not run through them (their gradient was 0 * ..., added to
        # every router's logit gradient: ~40 ops per step for nothing)
        weighted = cfg.router_aux_loss_coef != 0 or cfg.router_z_loss_coef > 0
        with torch.set_grad_enabled(torch.is_grad_enabled() and weighted):
            lb, z = router_losses(router_logits, cfg.num_experts, cfg.num_experts_per_tok,
                                  mask_N, self.router_stats_sum)  # fmt: skip
        aux = cfg.router_aux_loss_coef * lb
        if cfg.router_z_loss_coef > 0:
            aux = aux + cfg.router_z_loss_coef * z
        if packing is not None:  # one scatter for all layers (M, L, E) -> (N, L, E)
            router_logits = list(packing.unpack(torch.stack(router_logits, dim=1)).unbind(1))
        return ModelOutput(
            logits_BTV,
            aux,
            tuple(router_logits),
            lb.detach(),
            z.detach(),
            hidden,
            rows_M,
        )

    @torch.no_grad()
    def select_experts(self, router_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """(L, N, k) the experts each MoE layer's routing scheme selects from its router logits
        (`ModelOutput.router_logits`), the correction bias included: the live top-k that the
        train-inference mismatch metrics compare with the recorded routing (rl/routing.py)."""
        blocks = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
        return torch.stack([b.scheme.select(g, b.gate.e_score_correction_bias)
                            for b, g in zip(blocks, router_logits, strict=True)])  # fmt: skip

    def num_parameters(self, active: bool = False) -> int:
        """All parameters, or (active=True) those one token uses: top-k of E routed experts."""
        total = sum(p.numel() for p in self.parameters())
        if not active:
            return total
        cfg = self.config
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        inactive = (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
        return total - inactive * len(self.moe_layer_ids)
