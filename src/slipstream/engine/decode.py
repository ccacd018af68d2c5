"""The native engine's decode step: forward, sampling and bookkeeping of every running row as one
callable over the running batch's static buffers, with one device-to-host copy per step.

`DecodeStep(num_rows)` runs, on the device and without reading anything back:
1. the model over rows [0, B) of the slot cache (`SlotKVCache.begin_decode` with a key span the
   host knows from its own mirror of the rows' positions, so nothing waits for the device), the
   MoE blocks on their static expert path (`static_moe`: no host split sizes),
2. sampling (`sample_rows`: temperature, top-k/top-p/min-p, counter-based per-row seeds, top-n
   alternatives; `sampling.py`),
3. bookkeeping: the token, behaviour logprob and policy version (a device tensor, so a captured
   graph reads the current one) stored at each row's next output index, positions advanced, MoE
   routing recorded for rows that asked (R3), finish flags (stop token, token limit, slot end),
then copies (tokens, logprobs, finish flags) to the host in one transfer.

CUDA graphs (`engine.cuda_graphs`, CUDA only): the device part is captured per batch bucket
(1, 2, 4, ..., num_slots rows, the live rows padded up to the bucket) and per sampling variant
(the host flags that pick its code path: all-greedy, filters, top-n width, routing), with the key
span fixed at the slot length, and replayed; captured lazily at first use of a key (the rows'
small state is restored after the capture's warm-up runs, so a capture can happen while rows are
live). Weights are updated in place (`weights.apply_weights`), so graphs stay valid across
hot-swaps; `weights_updated` refreshes the attention's fused q/k/v copies in place. Padding rows
of a bucket are free slots whose position and counters are reset before every replay, so they
write only into their own (free) slot. On CPU, or with graphs off, the same function runs eagerly at the exact
row count and key span.

Legend: B live rows, P bucket rows (B <= P), V vocabulary, L MoE layers, k experts per token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from slipstream.engine.batch import RunningBatch
from slipstream.engine.routing import RoutingRecorder
from slipstream.engine.sampling import RowParams, raw_top_logprobs, sample
from slipstream.model.layers import Attention
from slipstream.model.moe_block import SparseMoeBlock

log = logging.getLogger(__name__)


@contextmanager
def static_moe(blocks: list[SparseMoeBlock]) -> Iterator[None]:
    """Within the block, the MoE blocks run the static expert path (`moe.static_experts`: no host
    sync, static shapes) whatever their configured `moe_impl`; restored after (the model may
    also be trained, whose path is its own)."""
    impls = [b.impl for b in blocks]
    for b in blocks:
        b.impl = "static"
    try:
        yield
    finally:
        for b, impl in zip(blocks, impls, strict=True):
            b.impl = impl


def engine_forward(
    model: torch.nn.Module,
    routing: RoutingRecorder,
    ids_BT: torch.Tensor,
    pos_BT: torch.Tensor,
    cache: Any,
    record_routing: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The engine's forward over its cache (decode or admission): MoE blocks on the static
    expert path; -> (logits [B, T, V], routing [B*T, L, k] when `record_routing`, else None)."""
    with static_moe(routing.blocks):
        if not record_routing:
            return model(ids_BT, position_ids_BT=pos_BT, cache=cache).logits_BTV, None
        with routing.capture() as ids:
            logits_BTV = model(ids_BT, position_ids_BT=pos_BT, cache=cache).logits_BTV
        return logits_BTV, routing.stack(ids)


def sample_rows(
    batch: RunningBatch, logits_RV: torch.Tensor, rp: RowParams, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token for rows [0, R) and record it in the batch (token, logprob, version,
    top-n alternatives when some row wants them; advances gen and the fed-back token).
    -> (tokens [R], logprobs [R]). No host sync."""
    u_R = batch.uniforms(num_rows)
    # Top-n alternatives: the model's raw distribution, as SGLang and vLLM report them (see
    # sampling.py), not the processed one the token was sampled from.
    top = raw_top_logprobs(logits_RV, batch.top_width) if batch.top_width else None
    tokens_R, logprobs_R = sample(logits_RV, rp, u_R)
    batch.record(0, tokens_R, logprobs_R, batch.version_1, top)
    return tokens_R, logprobs_R


@dataclass
class StepOutput:
    """One step on the host: per row (of the B live rows) its sampled token and behaviour
    logprob, and the rows that finished."""

    tokens: list[int]
    logprobs: list[float]
    done: list[int]


def pack(tokens_R: torch.Tensor, logprobs_R: torch.Tensor, done_R: torch.Tensor) -> torch.Tensor:
    """A step's results as one [3, R] float64 tensor for its one host copy: tokens (exact in
    float64 below 2**53), logprobs (float32 values, exact in float64), finish flags."""
    return torch.stack((tokens_R.double(), logprobs_R.double(), done_R.double()))


def to_host(tokens_R: torch.Tensor, logprobs_R: torch.Tensor, done_R: torch.Tensor) -> StepOutput:
    """`pack`, then the step's one device-to-host copy."""
    return unpack(pack(tokens_R, logprobs_R, done_R).cpu())


def unpack(host_3R: torch.Tensor) -> StepOutput:
    tokens, logprobs, done = host_3R.tolist()
    return StepOutput([int(t) for t in tokens], logprobs, [i for i, d in enumerate(done) if d])


class DecodeStep:
    """See the module docstring. `forward_s` accumulates the time inside model forwards (eager:
    the model call, on CUDA its launch time; a replayed graph: the replay and the host copy that
    waits for it, sampling included)."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: RunningBatch,
        routing: RoutingRecorder,
        cuda_graphs: bool,
    ) -> None:
        self.model, self.batch, self.routing = model, batch, routing
        cache = batch.cache
        self.buckets = _buckets(cache.num_slots)
        self.cuda_graphs = cuda_graphs
        self._graphs: dict[tuple, tuple[Any, torch.Tensor]] = {}
        self._pool: Any = None
        self._layout_version = batch.layout_version
        self.forward_s = 0.0
        self.graph_fallback: str | None = None
        """Why graphs were turned off at run time (logged once), None while they serve."""

    @property
    def num_graphs(self) -> int:
        """CUDA graphs captured and held (one per bucket and sampling variant used so far)."""
        return len(self._graphs)

    # ---- device part ---------------------------------------------------------------------

    def device_step(self, rows: int, max_pos: int) -> torch.Tensor:
        """Forward + sampling + bookkeeping of rows [0, rows) on the device, no host sync.
        -> packed [3, rows] float64 (tokens, logprobs, finish flags)."""
        batch = self.batch
        pos_R = batch.pos_N[:rows]
        batch.cache.begin_decode(pos_R, max_pos)
        t0 = time.perf_counter()
        logits_R1V, route_RLk = engine_forward(self.model, self.routing, batch.last_N[:rows, None],
                                               pos_R[:, None], batch.cache, batch.any_routing)  # fmt: skip
        self.forward_s += time.perf_counter() - t0
        pos_R += 1
        if route_RLk is not None:
            batch.record_routing(route_RLk)
        rp = batch.params_for(rows)
        tokens_R, logprobs_R = sample_rows(batch, logits_R1V[:, -1], rp, rows)
        return pack(tokens_R, logprobs_R, batch.done_mask(0, tokens_R))

    # ---- host part -----------------------------------------------------------------------

    def __call__(self, num_rows: int) -> StepOutput:
        """One decode step of the B = num_rows live rows (the batch's rows [0, B))."""
        batch = self.batch
        batch.params()  # refresh the composition-derived flags (routing, top-n, streaming)
        if self.cuda_graphs and self.graph_fallback is None:
            try:
                t0 = time.perf_counter()
                packed = self._replay(num_rows)
                host = packed[:, :num_rows].cpu()  # the one device-to-host copy
                self.forward_s += time.perf_counter() - t0
                batch.advance_host(num_rows)
                return unpack(host)
            except RuntimeError as e:  # a capture that fails: serve eagerly, say so once
                self.graph_fallback = f"CUDA graph capture failed, decoding eagerly: {e}"
                log.error("%s", self.graph_fallback)
                self._graphs.clear()
                packed = self.device_step(num_rows, batch.max_pos(num_rows))
        else:
            packed = self.device_step(num_rows, batch.max_pos(num_rows))
        batch.advance_host(num_rows)
        return unpack(packed[:, :num_rows].cpu())  # the one device-to-host copy

    # ---- CUDA graphs ---------------------------------------------------------------------

    def _replay(self, num_rows: int) -> torch.Tensor:
        batch = self.batch
        if batch.layout_version != self._layout_version:  # a buffer was reallocated
            self._graphs.clear()
            self._layout_version = batch.layout_version
        rows = next(b for b in self.buckets if b >= num_rows)
        rp = batch.params()
        key = (rows, rp.all_greedy, rp.any_greedy, rp.needs_filter, batch.top_width,
               batch.any_routing)  # fmt: skip
        self.reset_padding(num_rows, rows)  # before a capture too: its warm-up runs execute
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(rows)
            self._graphs[key] = entry
        graph, out = entry
        graph.replay()
        return out

    def reset_padding(self, num_rows: int, rows: int) -> None:
        """Padding rows [num_rows, rows) of a bucket advance with it at every step: put them
        back at position 0 with nothing generated, so their writes stay inside their own (free)
        slot and their indices inside the buffers (their GDN states zeroed: a free slot's
        recurrent state does not drift over steps)."""
        for t in self.batch.step_state():
            t[num_rows:rows] = 0
        if rows > num_rows:
            self.batch.cache.reset_linear_state(slice(num_rows, rows))

    def _capture(self, rows: int) -> tuple[Any, torch.Tensor]:
        """Capture `device_step(rows)` with the key span fixed at the slot length. The warm-up
        runs (needed before capture) really execute: the rows' small state is saved and put
        back, so the live rows see no step; what they wrote (KV at each row's next position,
        outputs at its next index) is rewritten by the real step; GDN states are put back too)."""
        batch = self.batch
        max_pos = batch.cache.slot_len - 1
        # the GDN states too: a warm-up step advances them, and unlike a K/V page (rewritten
        # at the same position by the real step) a recurrent state would carry it on
        state = (*batch.step_state(), *batch.cache.linear_state_tensors())
        saved = [t.clone() for t in state]

        def restore() -> None:  # a row one short of its slot's end must not step twice
            for t, s in zip(state, saved, strict=True):
                t.copy_(s)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.device_step(rows, max_pos)
                    restore()
            torch.cuda.current_stream().wait_stream(stream)
        finally:  # also when a warm-up run fails: the eager fallback must see the rows as they were
            restore()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.device_step(rows, max_pos)
        self._pool = graph.pool()
        return graph, out

    def weights_updated(self) -> None:
        """After an in-place weight copy: refresh what the model derives from its weights
        (the attention's fused q/k/v copies and the cache's sink columns, rebuilt into the same
        storage, so captured graphs read the new weights)."""
        for m in self.model.modules():
            if isinstance(m, Attention):
                m.refresh_inference_weights()
        with torch.inference_mode():
            self.batch.cache.refresh_sinks()


def _buckets(num_slots: int) -> list[int]:
    """1, 2, 4, ... below num_slots, then num_slots."""
    out, b = [], 1
    while b < num_slots:
        out.append(b)
        b *= 2
    return [*out, num_slots]
