"""Recorded MoE routing on its way from the engine to the trainer, and the train-inference
mismatch metrics.

Shape legend: T positions of one sample (P + C - 1: the trainer's input positions), L MoE
layers, k experts per token, B sequences, S the batch's padded positions.

- `pack(ids_TLk)` / `unpack(sample)`: a `Sample`'s `routed_experts` bytes (uint8 when every id
  fits, else int16) and back.
- `collate_routing(samples, T)`: the batch's recorded routing as (L, B*T, k) for
  `MoEForCausalLM.forward(replay_routing_LNk=...)`; padding rows route to expert 0 (their tokens
  are masked out of every loss).
- `MismatchStats`: per step, by staleness bucket 0 / 1 / 2+ (trainer version minus the version
  that produced the token): router agreement (fraction of (position, layer) whose live top-k set
  equals the recorded one), mean |trainer logp - behaviour logp| of sampled tokens, and the k3
  estimate of KL(behaviour || trainer) from the same tokens.

Memory: a sample's routing costs T x L x k bytes (uint8). At Qwen3-30B-A3B shapes (48 MoE
layers, top-8, 128 experts) that is 384 bytes per token: 1.5 MiB for a 4096-token sample, 96 MiB
for a 64-sample batch, kept in the buffer and the checkpoint's coordinator state (base64 there:
x 4/3). The `routing_bytes_per_sample` metric reports it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from slipstream.rl.types import Sample

BUCKETS = ("0", "1", "2+")


def pack(ids_TLk: torch.Tensor) -> tuple[bytes, tuple[int, int]]:
    """(bytes, (L, k)) of one sample's routing; uint8 when every id < 256, else int16."""
    if ids_TLk.dim() != 3:
        raise ValueError(f"routing must be (positions, layers, k), got {tuple(ids_TLk.shape)}")
    arr = ids_TLk.detach().cpu().numpy()
    dtype = np.uint8 if arr.size == 0 or int(arr.max()) < 256 else np.int16
    return arr.astype(dtype).tobytes(), (int(ids_TLk.shape[1]), int(ids_TLk.shape[2]))


def unpack(sample: Sample) -> torch.Tensor:
    """The sample's recorded routing as a (T, L, k) int64 tensor."""
    if not sample.routed_experts:
        raise ValueError("the sample carries no recorded routing (rollout.record_routing off?)")
    rows = len(sample.prompt_ids) + len(sample.completion_ids) - 1
    num_layers, k = sample.routing_shape
    itemsize = len(sample.routed_experts) // (rows * num_layers * k)
    arr = np.frombuffer(sample.routed_experts, dtype=np.uint8 if itemsize == 1 else np.int16)
    return torch.from_numpy(arr.astype(np.int64).reshape(rows, num_layers, k))


def collate_routing(samples: Sequence[Sample], T: int) -> torch.Tensor:
    """(L, B*T, k) int64: sample b's recorded routing at rows [b*T, b*T + len), zeros after."""
    first = unpack(samples[0])
    num_layers, k = first.shape[1], first.shape[2]
    out = torch.zeros(len(samples), T, num_layers, k, dtype=torch.long)
    for b, s in enumerate(samples):
        ids = first if b == 0 else unpack(s)
        if ids.shape[1:] != (num_layers, k):
            raise ValueError(f"sample {b}: routing {tuple(ids.shape[1:])}, batch {(num_layers, k)}")
        out[b, : ids.shape[0]] = ids
    return out.permute(2, 0, 1, 3).reshape(num_layers, len(samples) * T, k)


def staleness_bucket_BT(staleness_BT: torch.Tensor) -> torch.Tensor:
    """0, 1, 2 (= 2 or more) per position."""
    return staleness_BT.clamp(min=0, max=2)


class MismatchStats:
    """Sums over a step's minibatches (added over ranks by the trainer), then per-bucket means.
    Each `add_*` is a handful of tensor ops whatever the number of buckets (bincount), and one
    host sync."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}

    def _add_by_bucket(self, names: Sequence[str], bucket_M: torch.Tensor,
                       values: Sequence[torch.Tensor | None]) -> None:  # fmt: skip
        """sums[name_sB] += per-bucket sum of each value over the selected M items (None: the
        count)."""
        rows = [torch.bincount(bucket_M, weights=None if v is None else v.double(),
                               minlength=len(BUCKETS)).double() for v in values]  # fmt: skip
        table = torch.stack(rows).tolist()
        for name, per_bucket in zip(names, table, strict=True):
            for b, x in zip(BUCKETS, per_bucket, strict=True):
                key = f"{name}_s{b}"
                self.sums[key] = self.sums.get(key, 0.0) + x

    @torch.no_grad()
    def add_logprobs(self, logp_BT: torch.Tensor, behaviour_BT: torch.Tensor,
                     mask_BT: torch.Tensor, staleness_BT: torch.Tensor) -> None:  # fmt: skip
        d_M = (logp_BT - behaviour_BT).float()[mask_BT]
        k3_M = torch.exp(d_M) - d_M - 1.0  # KL(behaviour || trainer), sampled by behaviour
        bucket_M = staleness_bucket_BT(staleness_BT)[mask_BT]
        self._add_by_bucket(("mismatch_tokens", "logp_abs_diff_sum", "k3_sum"), bucket_M,
                            (None, d_M.abs(), k3_M))  # fmt: skip

    @torch.no_grad()
    def add_routing(self, router_logits: Sequence[torch.Tensor], recorded_LNk: torch.Tensor,
                    valid_N: torch.Tensor, staleness_N: torch.Tensor,
                    live_LNk: torch.Tensor | None = None) -> None:  # fmt: skip
        """`router_logits`: per MoE layer (N, E) of the trainer's forward; `valid_N`: real
        (non-padding) positions. `live_LNk`: the experts the model's routing scheme selects
        (`MoEForCausalLM.select_experts`: a sigmoid router's correction bias and groups
        included); None: the top-k of the logits (softmax routers)."""
        k = recorded_LNk.shape[-1]
        if live_LNk is None:
            logits_LNE = torch.stack([g.float() for g in router_logits])
            live_LNk = torch.topk(logits_LNE, k, dim=-1).indices
        live_LNk = live_LNk.sort(-1).values
        rec_LNk = recorded_LNk.to(live_LNk.device).sort(-1).values
        same_LN = (live_LNk == rec_LNk).all(-1)
        bucket_N = staleness_bucket_BT(staleness_N)
        bucket_M = bucket_N[valid_N].repeat(len(router_logits))
        same_M = same_LN[:, valid_N].reshape(-1)
        self._add_by_bucket(("routed_positions", "router_agree_sum"), bucket_M,
                            (None, same_M))  # fmt: skip


def mismatch_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Per-bucket means from (rank-summed) sums; a bucket with no tokens is left out."""
    out: dict[str, float] = {}
    for name in BUCKETS:
        n = sums.get(f"mismatch_tokens_s{name}", 0.0)
        if n:
            out[f"logp_abs_diff_s{name}"] = sums[f"logp_abs_diff_sum_s{name}"] / n
            out[f"k3_kl_s{name}"] = sums[f"k3_sum_s{name}"] / n
        r = sums.get(f"routed_positions_s{name}", 0.0)
        if r:
            out[f"router_agreement_s{name}"] = sums[f"router_agree_sum_s{name}"] / r
    total_r = sum(sums.get(f"routed_positions_s{b}", 0.0) for b in BUCKETS)
    if total_r:
        out["router_agreement"] = (
            sum(sums.get(f"router_agree_sum_s{b}", 0.0) for b in BUCKETS) / total_r
        )
    total_n = sum(sums.get(f"mismatch_tokens_s{b}", 0.0) for b in BUCKETS)
    if total_n:
        out["logp_abs_diff"] = sum(sums[f"logp_abs_diff_sum_s{b}"] for b in BUCKETS
                                   if f"logp_abs_diff_sum_s{b}" in sums) / total_n  # fmt: skip
        out["k3_kl"] = (
            sum(sums[f"k3_sum_s{b}"] for b in BUCKETS if f"k3_sum_s{b}" in sums) / total_n
        )
    return out
