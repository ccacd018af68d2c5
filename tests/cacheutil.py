"""Driving the engine's SlotKVCache by hand, the way the engine does, for model-level tests:
every row b of a batch lives in slot b."""

from __future__ import annotations

import torch

from slipstream.engine.kv_cache import Part, SlotKVCache


def extend_rows(model, cache: SlotKVCache, ids_BT: torch.Tensor, start: int) -> torch.Tensor:
    """Row b's tokens go to positions [start, start + T) of slot b (attending to what the slot
    holds before start), all rows in one ragged [1, B*T] forward; -> logits (B, T, V)."""
    B, T = ids_BT.shape
    parts = [Part(b, b * T, T, start) for b in range(B)]
    cache.begin_mixed(torch.empty(0, dtype=torch.long), -1, parts)
    pos_1N = (start + torch.arange(T)).repeat(B)[None]
    out = model(ids_BT.reshape(1, -1), position_ids_BT=pos_1N, cache=cache).logits_BTV
    return out.view(B, T, -1)


def decode_rows(model, cache: SlotKVCache, ids_B1: torch.Tensor, pos: int) -> torch.Tensor:
    """One token per row at position `pos` of its slot; -> logits (B, 1, V)."""
    pos_B = torch.full((ids_B1.shape[0],), pos)
    cache.begin_decode(pos_B, pos)
    return model(ids_B1, position_ids_BT=pos_B[:, None], cache=cache).logits_BTV
