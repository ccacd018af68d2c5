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

Legend: L layers, N slots, K kv heads, H query heads, S slot length, D head dim, B rows,
T tokens in this forward, P tokens of one prompt.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from slipstream.model.attention import sdpa
from slipstream.model.attention_variants import additive, allowed_TS, sink_sdpa


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, without dispatching a no-op cast (decode is per-op overhead bound)."""
    return x if x.dtype == dtype else x.to(dtype)


class Part(NamedTuple):
    """New tokens of one slot in a mixed forward: tokens [offset, offset + length) of the
    forward go to positions [start, start + length) of `slot`."""

    slot: int
    offset: int
    length: int
    start: int = 0


class SlotKVCache:
    """k/v storage for `num_slots` sequences of up to `slot_len` tokens each."""

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
    ) -> None:
        """`sink_key`: keep the zero sink key in front of each slot (see the module docstring);
        a layer that passes `sinks_H` needs it."""
        self._off = 1 if sink_key else 0
        shape = (num_layers, num_slots, num_kv_heads, self._off + slot_len, head_dim)
        # `raw` holds the sink position first (when kept); k_LNKSD / v_LNKSD are positions 0.. on
        self._k_raw = torch.zeros(shape, dtype=dtype, device=device)
        self._v_raw = torch.zeros(shape, dtype=dtype, device=device)
        self.k_LNKSD = self._k_raw[:, :, :, self._off :]
        self.v_LNKSD = self._v_raw[:, :, :, self._off :]
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
        """A cache sized for `model` (an MoEForCausalLM), on its device and in its dtype."""
        cfg, param = model.config, next(model.parameters())
        return cls(cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, slot_len,
                   cfg.head_dim, dtype=param.dtype, device=param.device,
                   sink_key=cfg.attention_sinks)  # fmt: skip

    @property
    def nbytes(self) -> int:
        return self._k_raw.nbytes + self._v_raw.nbytes

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

    def _decode_attend(self, layer_idx, k_NKSD, v_NKSD, q_BHTD, k_BKTD, v_BKTD, window=None,  # noqa: ANN001
                       sinks_H=None) -> torch.Tensor:  # fmt: skip
        k_NKSD.index_put_(self._put_BK1, _as(k_BKTD, k_NKSD.dtype))
        v_NKSD.index_put_(self._put_BK1, _as(v_BKTD, v_NKSD.dtype))
        keys_BKSD, values_BKSD = self._keys_L[layer_idx], self._values_L[layer_idx]
        # The G = H / K query heads of a kv head as G queries of one head: SDPA then sees equal
        # head counts, which its fused kernels with a mask take (CUDA: memory-efficient/cuDNN;
        # masked enable_gqa falls back to the math kernel), and one mask serves all of them.
        B, H, _, D = q_BHTD.shape
        K = keys_BKSD.shape[1]
        q_BKGD = q_BHTD.reshape(B, K, -1, D)
        mask = self._mask_B11S if window is None else self._decode_mask(window)
        if self._off:  # the layer's sink logits in the sink key's column (-inf: no sinks)
            mask = mask + self._sink_column(layer_idx, sinks_H, K)[..., : mask.shape[-1]]
        out_BKGD = F.scaled_dot_product_attention(q_BKGD, keys_BKSD, values_BKSD, attn_mask=mask)
        return out_BKGD.view(B, H, 1, D)

    def _sink_column(
        self, layer_idx: int, sinks_H: torch.Tensor | None, num_kv: int
    ) -> torch.Tensor:
        """(1, K, G, 1 + S): the layer's sink logits in column 0 (-inf for a layer without
        sinks), zeros after; added to the step's mask (two ops per layer). Cached per layer,
        rebuilt in place when the sinks change (their version counter or storage), so a captured
        CUDA graph reads the new values."""
        key = (-1, -1) if sinks_H is None else (sinks_H._version, sinks_H.data_ptr())
        cached = self._sink_cols.get(layer_idx)
        if cached is None or cached[0] != key:
            if sinks_H is None:
                col = self.k_LNKSD.new_full((1, 1, 1, 1), float("-inf"))
            else:
                H = sinks_H.shape[0]
                col = sinks_H.detach().to(self.k_LNKSD.dtype).view(1, num_kv, H // num_kv, 1)
            new = F.pad(col, (0, self.slot_len))
            if cached is not None:
                new = cached[1].copy_(new)
            cached = self._sink_cols[layer_idx] = (key, new, sinks_H)
        return cached[1]

    def refresh_sinks(self) -> None:
        """Bring the cached sink columns up to date after an in-place weight update (in their
        storage): a replayed CUDA graph runs no Python to notice (DecodeStep.weights_updated)."""
        for layer_idx, (_, _, sinks_H) in list(self._sink_cols.items()):
            if sinks_H is not None:
                self._sink_column(layer_idx, sinks_H, self.k_LNKSD.shape[2])

    def _mixed_attend(self, layer_idx, k_NKSD, v_NKSD, q_1HTD, k_1KTD, v_1KTD, window=None,  # noqa: ANN001
                      sinks_H=None) -> torch.Tensor:  # fmt: skip
        num_rows = self._rows_B.shape[0]
        outs = []
        if num_rows:
            # [1, H, B, D] -> [B, H, 1, D]: each decode token becomes its own batch row.
            def rows(x: torch.Tensor) -> torch.Tensor:
                return x[0, :, :num_rows].transpose(0, 1).unsqueeze(2)

            out_BH1D = self._decode_attend(
                layer_idx,
                k_NKSD,
                v_NKSD,
                rows(q_1HTD),
                rows(k_1KTD),
                rows(v_1KTD),
                window,
                sinks_H,
            )
            outs.append(out_BH1D[:, :, 0].transpose(0, 1).unsqueeze(0))
        for slot, offset, length, start in self._parts:
            end = start + length
            k_NKSD[slot, :, start:end] = k_1KTD[0, :, offset : offset + length].to(k_NKSD.dtype)
            v_NKSD[slot, :, start:end] = v_1KTD[0, :, offset : offset + length].to(v_NKSD.dtype)
            q_1HPD = q_1HTD[:, :, offset : offset + length]
            if window is not None or sinks_H is not None:
                if self._off:  # build the layer's sink column now, not in the first decode step
                    self._sink_column(layer_idx, sinks_H, k_NKSD.shape[1])
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
        k_NKSD, v_NKSD = self._k_L[layer_idx], self._v_L[layer_idx]
        if sinks_H is not None and not self._off:
            raise ValueError("a layer with attention sinks needs SlotKVCache(sink_key=True)")
        if self._mode == "mixed":
            return self._mixed_attend(layer_idx, k_NKSD, v_NKSD, q_BHTD, k_BKTD, v_BKTD, window,
                                      sinks_H)  # fmt: skip
        if self._mode == "decode":
            if q_BHTD.shape[2] != 1:
                raise ValueError(f"decode takes one token per row, got {q_BHTD.shape[2]}")
            return self._decode_attend(layer_idx, k_NKSD, v_NKSD, q_BHTD, k_BKTD, v_BKTD, window,
                                       sinks_H)  # fmt: skip
        raise RuntimeError("SlotKVCache.attend called before begin_decode/begin_mixed")

    def copy_prefix(self, src_slot: int, dst_slots: torch.Tensor, length: int) -> None:
        """Copy the first `length` positions of one slot into others (group prefix sharing)."""
        if dst_slots.numel() == 0:
            return
        self.k_LNKSD[:, dst_slots, :, :length] = self.k_LNKSD[
            :, src_slot : src_slot + 1, :, :length
        ]
        self.v_LNKSD[:, dst_slots, :, :length] = self.v_LNKSD[
            :, src_slot : src_slot + 1, :, :length
        ]

    def move(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Move a sequence to another slot (compaction when a row leaves the batch)."""
        self.k_LNKSD[:, dst_slot, :, :length] = self.k_LNKSD[:, src_slot, :, :length]
        self.v_LNKSD[:, dst_slot, :, :length] = self.v_LNKSD[:, src_slot, :, :length]
