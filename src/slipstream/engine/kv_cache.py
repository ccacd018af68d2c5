"""Preallocated slot KV cache that plugs into the model's attention seam.

The model's attention layers call `cache.attend(layer_idx, q_BHTD, k_BKTD, v_BKTD)`; this cache
decides where k/v are stored and what each query may see. Storage is one tensor per k and v of
shape [L, N, K, S, D]: N slots of S positions each, allocated once (the engine's KV budget).

The engine keeps its running rows compacted (batch row i lives in slot i), so a decode step reads
slots [0, B) as a view with no gather. Two modes, set before each forward:

- `begin_decode(pos_B)`: one new token per row for rows [0, B), written at position pos_B[b];
  row b attends over positions [0, pos_B[b]] (its own valid prefix plus the new token).
- `begin_mixed(pos_B, parts)`: one ragged forward of shape [1, T]: first one decode token for
  each row [0, B) (as in decode), then the tokens of each `Part` (slot, offset, length, start)
  laid end to end, each written to positions [start, start + length) of its slot, attending to
  the slot's cached positions [0, start) and causally within itself. start = 0 is a new prompt;
  start > 0 extends a cached prefix (a later chunk, or the next turn of a conversation) without
  re-prefilling it. Newly admitted tokens thus ride in the same forward as the running rows
  instead of costing a forward of their own.

This is slipstream's one KV cache: the engine's (rollouts, evaluation, serving). Positions are
given per call, so rewriting a position (rolling back to a shorter prefix) is just writing it
again. Not covered: paging, prefix sharing across requests other than a group's copy.

Attention variants (the `window` and `sinks_H` keywords of `attend`, model/attention_variants.py):
- Sliding-window layers keep every position of the slot, like full layers, and mask the keys
  that left the window (a query at position p sees (p - window, p]): the masks are built once
  per step per window size, no per-layer work. Memory is that of a full layer (a ring buffer of
  `window` positions would save (S - window) / S of a sliding layer's KV, half of GPT-OSS's KV at
  S >> 128; not done: the prefix cache and slot moves address positions directly).
- Sinks (`sink_key=True`, `for_model` sets it when the model has them): the storage holds one
  more position in front of position 0 of each slot, always zero, the sink's key and value
  (`k_LNKSD` is the view from position 0 on, so every other user addresses positions as
  before). Decode reads it with the other keys (no copy) and puts the layer's sink logits in its
  mask column: one cat per layer and step.

Per-layer state (the hybrid and latent-attention families, docs/engine.md "Per-layer state"):
- K/V pages are kept for the attention layers only (`attention_layers`; `k_LNKSD` is indexed by
  an attention layer's rank among them, `attend` maps the model's layer index).
- MLA layers store their expanded K and V: H heads each, K `qk_nope + qk_rope` wide and V
  `v_head_dim` wide (`v_head_dim`: V's own width, K's by default), not the compressed latent.
- Gated DeltaNet layers (`linear_layers`) keep per slot a fixed-size state: the conv window
  `conv_LNCw` (the last W - 1 conv inputs, activation dtype) and the recurrent state `rec_LNHKV`
  (float32), allocated once. `linear_mix` runs a GDN layer on them: decode rows [0, B) on the
  first B slots' states (the recurrent form, one step), each admitted `Part` on its slot's state
  (the chunked form). A part starting at position 0 starts from a zero state (zeroed by
  `begin_mixed`: a reassigned slot keeps nothing of its last sequence); a part starting later
  continues the slot's state, which must then be that of position `start` (an earlier part of
  the same forward, or a snapshot the prefix cache loaded: a `Part` with `snapshot` set copies
  the states at its end into the snapshot pool, `load_snapshot` puts one back into a slot).
  `copy_prefix` and `move` copy the state with the pages. Per sequence, GDN state is constant
  in the context length; only the attention layers' pages grow with it (`bytes_per_slot`).

Legend: L layers, N slots, K kv heads, H query heads, S slot length, D head dim (Dv: V's),
B rows, T tokens in this forward, P tokens of one prompt, C conv channels, w conv window,
Hv/Dk/Dv of a GDN state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from slipstream.model.attention import sdpa
from slipstream.model.attention_variants import additive, allowed_TS, sink_sdpa
from slipstream.model.gated_deltanet import GDNState
from slipstream.model.mla import MLAttention


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, without dispatching a no-op cast (decode is per-op overhead bound)."""
    return x if x.dtype == dtype else x.to(dtype)


class Part(NamedTuple):
    """New tokens of one slot in a mixed forward: tokens [offset, offset + length) of the
    forward go to positions [start, start + length) of `slot`. `snapshot` >= 0: after this
    part, copy the slot's GDN states (those of position start + length) into that row of the
    snapshot pool (`allocate_snapshots`; the prefix cache's GDN prefixes)."""

    slot: int
    offset: int
    length: int
    start: int = 0
    snapshot: int = -1


class LinearStateShape(NamedTuple):
    """One Gated DeltaNet layer's per-sequence state: conv window (conv_channels,
    conv_kernel - 1) and recurrent state (value_heads, key_dim, value_dim), float32."""

    conv_channels: int
    conv_kernel: int
    value_heads: int
    key_dim: int
    value_dim: int


class SlotKVCache:
    """k/v storage for `num_slots` sequences of up to `slot_len` tokens each (and the GDN
    layers' fixed-size state per sequence; see the module docstring)."""

    length = None
    """`KVCache.length`: not tracked here (rows sit at different positions; the engine passes
    position ids with every forward)."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        slot_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        sink_key: bool = False,
        v_head_dim: int | None = None,
        linear_layers: Sequence[int] = (),
        linear_state: LinearStateShape | None = None,
    ) -> None:
        """`num_layers`: the model's layers; those in `linear_layers` are Gated DeltaNet layers
        with a `linear_state` each, the others attention layers with K/V pages. `v_head_dim`:
        V's width when it differs from K's (MLA). `sink_key`: keep the zero sink key in front
        of each slot (see the module docstring); a layer that passes `sinks_H` needs it."""
        if linear_layers and linear_state is None:
            raise ValueError(f"linear_layers {list(linear_layers)} need a linear_state shape")
        linear = sorted(set(linear_layers))
        if linear and not 0 <= linear[0] <= linear[-1] < num_layers:
            raise ValueError(f"linear_layers {linear} outside the model's {num_layers} layers")
        self.linear_layers = linear
        self.attention_layers = [i for i in range(num_layers) if i not in set(linear)]
        # model layer -> its rank among the attention (or linear) layers, -1 for the other kind
        self._attn_rank = [-1] * num_layers
        self._linear_rank = [-1] * num_layers
        for r, i in enumerate(self.attention_layers):
            self._attn_rank[i] = r
        for r, i in enumerate(linear):
            self._linear_rank[i] = r
        self._off = 1 if sink_key else 0
        num_attn = len(self.attention_layers)
        shape = (num_attn, num_slots, num_kv_heads, self._off + slot_len, head_dim)
        v_shape = (*shape[:-1], v_head_dim or head_dim)
        # `raw` holds the sink position first (when kept); k_LNKSD / v_LNKSD are positions 0.. on
        self._k_raw = torch.zeros(shape, dtype=dtype, device=device)
        self._v_raw = torch.zeros(v_shape, dtype=dtype, device=device)
        self.k_LNKSD = self._k_raw[:, :, :, self._off :]
        self.v_LNKSD = self._v_raw[:, :, :, self._off :]
        ls = linear_state or LinearStateShape(0, 1, 0, 0, 0)
        n_lin = len(linear)
        self.conv_LNCw = torch.zeros((n_lin, num_slots, ls.conv_channels, ls.conv_kernel - 1),
                                     dtype=dtype, device=device)  # fmt: skip
        self.rec_LNHKV = torch.zeros((n_lin, num_slots, ls.value_heads, ls.key_dim, ls.value_dim),
                                     dtype=torch.float32, device=device)  # fmt: skip
        self._conv_L = self.conv_LNCw.unbind(0)
        self._rec_L = self.rec_LNHKV.unbind(0)
        self.allocate_snapshots(0)
        self.num_slots = num_slots
        self.slot_len = slot_len
        self._mode = ""
        self._rows_B: torch.Tensor | None = None
        self._pos_B: torch.Tensor | None = None
        self._mask_B11S: torch.Tensor | None = None
        self._masks: dict[int | None, torch.Tensor] = {}
        self._sink_cols: dict[int, tuple[tuple[int, int], torch.Tensor, torch.Tensor | None]] = {}
        self._span = 0
        self._parts: list[Part] = []
        self._slots_N = torch.arange(num_slots, device=device)
        self._span_S = torch.arange(slot_len, device=device)
        self._heads_K = torch.arange(num_kv_heads, device=device)
        self._put_BK1: tuple[torch.Tensor, ...] = ()
        self._keys_L: tuple[torch.Tensor, ...] = ()
        self._values_L: tuple[torch.Tensor, ...] = ()
        # Per-layer views made once (storage never moves): no select op per layer and step.
        self._k_L = self.k_LNKSD.unbind(0)
        self._v_L = self.v_LNKSD.unbind(0)

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_slots: int, slot_len: int) -> SlotKVCache:
        """A cache sized for `model` (an MoEForCausalLM), on its device and in its dtype: K/V
        pages for its attention layers (MLA: H heads of K `qk_nope + qk_rope` and V
        `v_head_dim` wide), a GDN state per slot for its Gated DeltaNet layers."""
        cfg, param = model.config, next(model.parameters())
        layers = list(model.model.layers)
        linear = [i for i, layer in enumerate(layers) if layer.linear_attn is not None]
        mla = [layer.self_attn for layer in layers
               if layer.linear_attn is None and isinstance(layer.self_attn, MLAttention)]  # fmt: skip
        heads, head_dim, v_dim = cfg.num_key_value_heads, cfg.head_dim, None
        if mla:  # every attention layer of an MLA model is MLA
            heads, head_dim, v_dim = mla[0].num_heads, mla[0].qk_head_dim, mla[0].v_head_dim
        state = None
        if linear:
            gdn = layers[linear[0]].linear_attn
            state = LinearStateShape(gdn.conv_dim, gdn.conv_kernel_size, gdn.num_v_heads,
                                     gdn.head_k_dim, gdn.head_v_dim)  # fmt: skip
        return cls(len(layers), num_slots, heads, slot_len, head_dim, dtype=param.dtype,
                   device=param.device, sink_key=cfg.attention_sinks, v_head_dim=v_dim,
                   linear_layers=linear, linear_state=state)  # fmt: skip

    @property
    def nbytes(self) -> int:
        return (self._k_raw.nbytes + self._v_raw.nbytes + self.conv_LNCw.nbytes
                + self.rec_LNHKV.nbytes)  # fmt: skip

    def bytes_per_slot(self) -> dict[str, int]:
        """One sequence's decode state in bytes, by layer kind: "attention" (K/V pages: grows
        with the slot length), "linear" (GDN conv window + recurrent state: constant)."""
        n = self.num_slots
        return {
            "attention": (self._k_raw.nbytes + self._v_raw.nbytes) // n,
            "linear": (self.conv_LNCw.nbytes + self.rec_LNHKV.nbytes) // n,
        }

    def linear_state_tensors(self) -> tuple[torch.Tensor, ...]:
        """The GDN states of every slot (a decode step advances them: a CUDA graph capture's
        warm-up saves and restores them)."""
        return (self.conv_LNCw, self.rec_LNHKV) if self.linear_layers else ()

    def allocate_snapshots(self, count: int) -> None:
        """A pool of `count` GDN state snapshots (every GDN layer's conv window and recurrent
        state of one sequence position), written by a `Part` with `snapshot` >= 0 and read back
        into a slot by `load_snapshot` (the prefix cache's GDN prefixes)."""
        n_lin = len(self.linear_layers)
        conv, rec = self.conv_LNCw, self.rec_LNHKV
        self.snap_conv_LPCw = conv.new_zeros((n_lin, count, *conv.shape[2:]))
        self.snap_rec_LPHKV = rec.new_zeros((n_lin, count, *rec.shape[2:]))
        self._snap_conv_L = self.snap_conv_LPCw.unbind(0)
        self._snap_rec_L = self.snap_rec_LPHKV.unbind(0)

    def load_snapshot(self, snapshot: int, slot: int) -> None:
        """Put a snapshot's GDN states into `slot` (its sequence then continues from there)."""
        self.conv_LNCw[:, slot] = self.snap_conv_LPCw[:, snapshot]
        self.rec_LNHKV[:, slot] = self.snap_rec_LPHKV[:, snapshot]

    def reset_linear_state(self, slots: torch.Tensor | slice) -> None:
        """Zero the GDN states of `slots` (a sequence starting at position 0)."""
        if self.linear_layers:
            self.conv_LNCw[:, slots] = 0
            self.rec_LNHKV[:, slots] = 0

    def begin_decode(self, pos_B: torch.Tensor, max_pos: int) -> None:
        """Rows [0, B) each write one token at pos_B[b] and read keys [0, max_pos]. `max_pos` is
        a bound the caller knows without reading pos_B (the engine mirrors its rows' positions
        on the host; a captured CUDA graph passes slot_len - 1, a key span fixed per bucket), so
        nothing here waits for the device. Keys past a row's own position are masked on device."""
        if max_pos >= self.slot_len:
            raise ValueError(f"decode position {max_pos} is past the slot length {self.slot_len}")
        self._mode = "decode"
        num_rows = pos_B.shape[0]
        self._span = max_pos + 1
        self._rows_B = self._slots_N[:num_rows]
        self._pos_B = pos_B
        # Index of each new k/v in a layer's [N, K, S, D] storage, broadcast to [B, K, 1]: the
        # attention's [B, K, 1, D] tensors are stored with one index_put each, no reshaping.
        self._put_BK1 = (self._rows_B[:, None, None], self._heads_K[None, :, None],
                         pos_B[:, None, None])  # fmt: skip
        # The keys of rows [0, B) up to the span (after the sink key, when kept), per layer:
        # one unbind per step instead of a select per layer (or two slices per layer and tensor).
        self._keys_L = self._k_raw[:, :num_rows, :, : self._off + self._span].unbind(0)
        self._values_L = self._v_raw[:, :num_rows, :, : self._off + self._span].unbind(0)
        # An additive float mask, built once per step: SDPA would otherwise convert a bool mask in
        # every layer (and its float-mask path measured faster on CPU).
        hidden_B11S = (self._span_S[: self._span] > pos_B[:, None])[:, None, None, :]
        self._mask_B11S = self._additive(hidden_B11S)
        self._masks = {None: self._mask_B11S}

    def _additive(self, hidden_B11S: torch.Tensor) -> torch.Tensor:
        """0 / -inf float mask of the hidden keys; with the sink key kept, a first column for it,
        0 here: `_decode_attend` adds the layer's sink logits there (-inf for a layer without)."""
        if self._off:
            hidden_B11S = F.pad(hidden_B11S, (1, 0), value=False)
        return torch.zeros_like(hidden_B11S, dtype=self.k_LNKSD.dtype).masked_fill_(
            hidden_B11S, float("-inf")
        )

    def _decode_mask(self, window: int | None) -> torch.Tensor:
        """The step's mask for a layer of this window (built at its first layer of the step)."""
        mask = self._masks.get(window)
        if mask is None:
            assert window is not None and self._pos_B is not None
            span_S = self._span_S[: self._span]
            pos_B1 = self._pos_B[:, None]
            hidden_B11S = ((span_S > pos_B1) | (span_S <= pos_B1 - window))[:, None, None, :]
            mask = self._masks[window] = self._additive(hidden_B11S)
        return mask

    def begin_mixed(self, pos_B: torch.Tensor, max_pos: int, parts: list[Part]) -> None:
        """`parts`: the new tokens of each slot (see `Part`); decode tokens occupy offsets
        [0, B). With no running rows pass an empty pos_B and max_pos -1."""
        for part in parts:
            if part.start + part.length > self.slot_len:
                raise ValueError(
                    f"cache overflow: slot {part.slot} positions [{part.start}, "
                    f"{part.start + part.length}) past the slot length {self.slot_len}"
                )
        if pos_B.numel():
            self.begin_decode(pos_B, max_pos)
        else:
            self._rows_B = pos_B
        self._mode = "mixed"
        self._parts = parts
        fresh = [p.slot for p in parts if p.start == 0]
        if fresh and self.linear_layers:  # new sequences start from a zero GDN state
            self.reset_linear_state(torch.tensor(fresh, device=self.conv_LNCw.device))

    def _decode_attend(self, rank, k_NKSD, v_NKSD, q_BHTD, k_BKTD, v_BKTD, window=None,  # noqa: ANN001
                       sinks_H=None) -> torch.Tensor:  # fmt: skip
        k_NKSD.index_put_(self._put_BK1, _as(k_BKTD, k_NKSD.dtype))
        v_NKSD.index_put_(self._put_BK1, _as(v_BKTD, v_NKSD.dtype))
        keys_BKSD, values_BKSD = self._keys_L[rank], self._values_L[rank]
        # The G = H / K query heads of a kv head as G queries of one head: SDPA then sees equal
        # head counts, which its fused kernels with a mask take (CUDA: memory-efficient/cuDNN;
        # masked enable_gqa falls back to the math kernel), and one mask serves all of them.
        B, H, _, D = q_BHTD.shape
        K = keys_BKSD.shape[1]
        q_BKGD = q_BHTD.reshape(B, K, -1, D)
        mask = self._mask_B11S if window is None else self._decode_mask(window)
        if self._off:  # the layer's sink logits in the sink key's column (-inf: no sinks)
            mask = mask + self._sink_column(rank, sinks_H, K)[..., : mask.shape[-1]]
        out_BKGD = F.scaled_dot_product_attention(q_BKGD, keys_BKSD, values_BKSD, attn_mask=mask)
        return out_BKGD.view(B, H, 1, values_BKSD.shape[-1])  # V's width (MLA: not K's)

    def _sink_column(self, rank: int, sinks_H: torch.Tensor | None, num_kv: int) -> torch.Tensor:
        """(1, K, G, 1 + S): the layer's (`rank`: among the attention layers) sink logits in column 0 (-inf for a layer without
        sinks), zeros after; added to the step's mask (two ops per layer). Cached per layer,
        rebuilt in place when the sinks change (their version counter or storage), so a captured
        CUDA graph reads the new values."""
        key = (-1, -1) if sinks_H is None else (sinks_H._version, sinks_H.data_ptr())
        cached = self._sink_cols.get(rank)
        if cached is None or cached[0] != key:
            if sinks_H is None:
                col = self.k_LNKSD.new_full((1, 1, 1, 1), float("-inf"))
            else:
                H = sinks_H.shape[0]
                col = sinks_H.detach().to(self.k_LNKSD.dtype).view(1, num_kv, H // num_kv, 1)
            new = F.pad(col, (0, self.slot_len))
            if cached is not None:
                new = cached[1].copy_(new)
            cached = self._sink_cols[rank] = (key, new, sinks_H)
        return cached[1]

    def refresh_sinks(self) -> None:
        """Bring the cached sink columns up to date after an in-place weight update (in their
        storage): a replayed CUDA graph runs no Python to notice (DecodeStep.weights_updated)."""
        for rank, (_, _, sinks_H) in list(self._sink_cols.items()):
            if sinks_H is not None:
                self._sink_column(rank, sinks_H, self.k_LNKSD.shape[2])

    def _mixed_attend(self, rank, k_NKSD, v_NKSD, q_1HTD, k_1KTD, v_1KTD, window=None,  # noqa: ANN001
                      sinks_H=None) -> torch.Tensor:  # fmt: skip
        num_rows = self._rows_B.shape[0]
        outs = []
        if num_rows:
            # [1, H, B, D] -> [B, H, 1, D]: each decode token becomes its own batch row.
            def rows(x: torch.Tensor) -> torch.Tensor:
                return x[0, :, :num_rows].transpose(0, 1).unsqueeze(2)

            out_BH1D = self._decode_attend(
                rank,
                k_NKSD,
                v_NKSD,
                rows(q_1HTD),
                rows(k_1KTD),
                rows(v_1KTD),
                window,
                sinks_H,
            )
            outs.append(out_BH1D[:, :, 0].transpose(0, 1).unsqueeze(0))
        for slot, offset, length, start, _ in self._parts:
            end = start + length
            k_NKSD[slot, :, start:end] = k_1KTD[0, :, offset : offset + length].to(k_NKSD.dtype)
            v_NKSD[slot, :, start:end] = v_1KTD[0, :, offset : offset + length].to(v_NKSD.dtype)
            q_1HPD = q_1HTD[:, :, offset : offset + length]
            if window is not None or sinks_H is not None:
                if self._off:  # build the layer's sink column now, not in the first decode step
                    self._sink_column(rank, sinks_H, k_NKSD.shape[1])
                # the variants' masks: query i at position start + i, keys [0, end) of the slot
                q_pos_P = torch.arange(start, end, device=q_1HTD.device)
                k_pos_S = torch.arange(end, device=q_1HTD.device)
                mask_11PS = additive(allowed_TS(q_pos_P, k_pos_S, window), q_1HPD.dtype)
                keys_1KSD = k_NKSD[slot : slot + 1, :, :end].to(q_1HPD.dtype)
                values_1KSD = v_NKSD[slot : slot + 1, :, :end].to(q_1HPD.dtype)
                outs.append(sink_sdpa(q_1HPD, keys_1KSD, values_1KSD, mask_11PS[None, None],
                                      sinks_H))  # fmt: skip
                continue
            if start == 0:  # a new prompt: causal over its own tokens
                k_1KPD = k_1KTD[:, :, offset : offset + length]
                v_1KPD = v_1KTD[:, :, offset : offset + length]
                outs.append(sdpa(q_1HPD, k_1KPD, v_1KPD, is_causal=True))
                continue
            # query i sits at position start + i and sees the cached prefix and itself
            q_pos_P1 = torch.arange(start, end, device=q_1HTD.device)[:, None]
            k_pos_1S = torch.arange(end, device=q_1HTD.device)[None, :]
            keys_1KSD = k_NKSD[slot : slot + 1, :, :end].to(q_1HPD.dtype)
            values_1KSD = v_NKSD[slot : slot + 1, :, :end].to(q_1HPD.dtype)
            outs.append(sdpa(q_1HPD, keys_1KSD, values_1KSD, mask_TS=k_pos_1S <= q_pos_P1))
        return torch.cat(outs, dim=2)

    def attend(
        self,
        layer_idx: int,
        q_BHTD: torch.Tensor,
        k_BKTD: torch.Tensor,
        v_BKTD: torch.Tensor,
        *,
        window: int | None = None,
        sinks_H: torch.Tensor | None = None,
    ) -> torch.Tensor:
        j = self._attn_rank[layer_idx]  # the layer's K/V storage (attention layers only)
        if j < 0:
            raise ValueError(f"layer {layer_idx} is a Gated DeltaNet layer: it has no K/V pages")
        k_NKSD, v_NKSD = self._k_L[j], self._v_L[j]
        if sinks_H is not None and not self._off:
            raise ValueError("a layer with attention sinks needs SlotKVCache(sink_key=True)")
        if self._mode == "mixed":
            return self._mixed_attend(j, k_NKSD, v_NKSD, q_BHTD, k_BKTD, v_BKTD, window, sinks_H)
        if self._mode == "decode":
            if q_BHTD.shape[2] != 1:
                raise ValueError(f"decode takes one token per row, got {q_BHTD.shape[2]}")
            return self._decode_attend(j, k_NKSD, v_NKSD, q_BHTD, k_BKTD, v_BKTD, window, sinks_H)
        raise RuntimeError("SlotKVCache.attend called before begin_decode/begin_mixed")

    def linear_mix(
        self,
        layer_idx: int,
        mixer: Callable[[torch.Tensor, GDNState], torch.Tensor],
        x_BTD: torch.Tensor,
    ) -> torch.Tensor:
        """`RecurrentStateCache.linear_mix` (model/mixers.py): a Gated DeltaNet layer over this
        forward's tokens, each row (decode) or part (mixed) on its slot's state, which the
        layer advances in place. Decode: rows [0, B) are slots [0, B), one token each (a view
        of the first B states: no gather, static shapes for a captured graph)."""
        g = self._linear_rank[layer_idx]
        if g < 0:
            raise ValueError(f"layer {layer_idx} is not a Gated DeltaNet layer of this cache")
        conv_NCw, rec_NHKV = self._conv_L[g], self._rec_L[g]
        if self._mode == "decode":
            B = x_BTD.shape[0]
            return mixer(x_BTD, GDNState(conv_NCw[:B], rec_NHKV[:B]))
        if self._mode != "mixed":
            raise RuntimeError("SlotKVCache.linear_mix called before begin_decode/begin_mixed")
        num_rows = self._rows_B.shape[0]
        outs = []
        if num_rows:  # [1, B, D] -> [B, 1, D]: each decode token on its own row's state
            x_B1D = x_BTD[0, :num_rows, None]
            state = GDNState(conv_NCw[:num_rows], rec_NHKV[:num_rows])
            outs.append(mixer(x_B1D, state)[:, 0][None])
        for slot, offset, length, _, snapshot in self._parts:
            state = GDNState(conv_NCw[slot : slot + 1], rec_NHKV[slot : slot + 1])
            outs.append(mixer(x_BTD[:, offset : offset + length], state))
            if snapshot >= 0:  # this layer's state at the part's end, for the prefix cache
                self._snap_conv_L[g][snapshot].copy_(conv_NCw[slot])
                self._snap_rec_L[g][snapshot].copy_(rec_NHKV[slot])
        return torch.cat(outs, dim=1)

    def copy_prefix(self, src_slot: int, dst_slots: torch.Tensor, length: int) -> None:
        """Copy the first `length` positions of one slot into others (group prefix sharing),
        with its GDN states (which must be those of position `length`)."""
        if dst_slots.numel() == 0:
            return
        self.k_LNKSD[:, dst_slots, :, :length] = self.k_LNKSD[
            :, src_slot : src_slot + 1, :, :length
        ]
        self.v_LNKSD[:, dst_slots, :, :length] = self.v_LNKSD[
            :, src_slot : src_slot + 1, :, :length
        ]
        for state in self.linear_state_tensors():
            state[:, dst_slots] = state[:, src_slot : src_slot + 1]

    def move(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Move a sequence to another slot (compaction when a row leaves the batch)."""
        self.k_LNKSD[:, dst_slot, :, :length] = self.k_LNKSD[:, src_slot, :, :length]
        self.v_LNKSD[:, dst_slot, :, :length] = self.v_LNKSD[:, src_slot, :, :length]
        for state in self.linear_state_tensors():
            state[:, dst_slot] = state[:, src_slot]
