"""slipstream's in-process inference engine: continuous batching over a preallocated slot KV cache.

One engine thread owns the model and the cache and loops: apply a pending weight update, drop
aborted rows, admit waiting requests that fit in free slots, then run one forward: a [B, 1] decode
of every live row, or, when requests were admitted, one ragged [1, T] forward holding the live
rows' decode tokens followed by the new prompts (their prefill rides in the same forward).
Requests therefore join and leave the running batch at every step; per step the engine adds a
handful of tensor ops (sampling, bookkeeping) and one host sync to the model forward.

- KV budget: `kv_cache_tokens` tokens split into slots of `max_seq_len` tokens (prompt + completion);
  at most min(max_batch_size, kv_cache_tokens // max_seq_len) sequences run at once. A group of n
  samples is admitted only when n slots are free (groups are never split).
- Group prefix sharing: the prompt of an n-sample request is prefilled once into the first slot of
  the group and its KV copied into the other n-1 slots (a group is admitted whole, never split).
- Sampling: see `sampling.py` (per-row parameters, counter-based per-request seeds).
- Weights: `update_weights(version, source)` takes a state dict or an HF-format directory. Policy
  (`weight_update_policy`): "finish_old" waits for the running rows to finish (new requests queue),
  "continue_new" swaps at the next step boundary (in-flight rows keep their old KV prefix),
  "abort" ends in-flight rows with finish_reason "abort". Per-token versions record the weights
  each token was sampled with. A source is read and validated (complete, shapes, floating
  dtypes, finite) on the caller's thread before the engine thread copies it in (`weights.py`):
  a bad source fails its caller and the old weights keep serving.
- Optional outputs, computed only for rows that ask (the default path adds no work): top-n
  alternatives per token (of the raw distribution: `sampling.raw_top_logprobs`), prompt logprobs
  (from the admission forward's logits, which cover every prompt position), MoE routing
  (`routing.py`: the blocks' sinks are set only for forwards with a row that records), and
  per-token streaming (`GenerateRequest.stream`).
- Failure isolation: a step that raises fails the requests in flight and the engine keeps
  serving; `error` is set (and `healthy` False) only when the engine can no longer serve (its
  thread ended, or a weight copy failed part-way).
- Prefix cache across requests (`engine.prefix_cache_tokens` > 0, `prefix_cache.py`): an
  admitted prompt's cached leading blocks are copied into its slot and only the rest is
  prefilled (a `Part` starting past 0); a finished row's sequence (and each admitted prompt) is
  stored when all its KV came from the weights now serving; cleared on every weight update.
  Requests asking for prompt logprobs or routing prefill in full (they need every position).
  Models with Gated DeltaNet layers: a prefix serves up to a block holding a snapshot of the GDN
  states, taken by splitting an admitted prompt's prefill at its last block boundary
  (`PrefixCache.snapshot_point`); their finished sequences are not stored.
- Per-layer state (`kv_cache.py`): K/V pages for attention layers (gated attention as plain;
  MLA's expanded K and V of different widths), a fixed-size conv window and recurrent state per
  slot for Gated DeltaNet layers (qwen3_next, qwen3_5_moe, deepseek_v3 serve; docs/engine.md).

Not covered: chunked prefill, preemption, tensor parallelism.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from slipstream.config.engine import EngineConfig
from slipstream.engine.base import (
    MAX_VERSION,
    Completion,
    GenerateRequest,
    PublishedWeights,
    StreamEvent,
    check_int,
)
from slipstream.engine.batch import Group, Row, RunningBatch
from slipstream.engine.decode import (
    DecodeStep,
    StepOutput,
    engine_forward,
    sample_rows,
    to_host,
)
from slipstream.engine.kv_cache import Part, SlotKVCache
from slipstream.engine.outputs import completion_routing, set_prompt_logprobs, stream_events
from slipstream.engine.prefix_cache import PrefixCache
from slipstream.engine.routing import RoutingRecorder
from slipstream.engine.weights import (
    PreparedWeights,
    WeightSource,
    apply_weights,
    exchange_weights,
    prepare_weights,
)

log = logging.getLogger(__name__)


class NativeEngine:
    """Continuous-batching engine around an `MoEForCausalLM` (or any model with the same
    `forward(input_ids_BT, position_ids_BT, cache)` and `cache.attend` seam).

    `tokenizer` (optional) decodes texts and supplies EOS; without it texts are "" and only
    stop_token_ids / `eos_token_ids` end samples. Close with `close()` (or use as a context manager).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig | None = None,
        tokenizer: Any = None,
        version: int = 0,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        cfg = model.config
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = torch.device(self.config.device)
        if self.config.dtype == "auto":
            self.model.to(self.device)
        else:  # weights and KV cache in the configured dtype
            self.model.to(self.device, getattr(torch, self.config.dtype))
        slot_len = self.config.max_seq_len or cfg.max_position_embeddings
        if slot_len > cfg.max_position_embeddings:
            raise ValueError(
                f"engine.max_seq_len={slot_len} exceeds the model's max_position_embeddings="
                f"{cfg.max_position_embeddings}"
            )
        num_slots = min(self.config.max_batch_size, self.config.kv_cache_tokens // slot_len)
        if num_slots < 1:
            raise ValueError(
                f"engine.kv_cache_tokens={self.config.kv_cache_tokens} holds no sequence of "
                f"{slot_len} tokens; raise it or lower engine.max_seq_len"
            )
        dtype = next(model.parameters()).dtype
        # per-layer state: K/V pages for attention layers (MLA: its expanded K/V), a fixed-size
        # recurrent state per slot for Gated DeltaNet layers (kv_cache.py)
        cache = SlotKVCache.for_model(self.model, num_slots, slot_len)
        self.batch = RunningBatch(cache, cfg.vocab_size, self.device)
        tokens = self.config.prefix_cache_tokens
        self.prefix_cache = PrefixCache(cache, tokens) if tokens else None
        if eos_token_ids is None:
            eos_token_ids = [tokenizer.eos_id] if tokenizer is not None else []
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._routing = RoutingRecorder(self.model)
        self._version = version
        self.batch.version_1.fill_(version)
        graphs = self.config.cuda_graphs and self.device.type == "cuda"
        if graphs and dtype != torch.bfloat16:
            # The static expert path runs torch._grouped_mm, which on CUDA takes bfloat16 only;
            # in another dtype the experts read split sizes on the host, which a graph cannot.
            log.warning("engine.cuda_graphs off: the model is %s on CUDA; set engine.dtype = "
                        "'bfloat16' for graph-captured decode", dtype)  # fmt: skip
            graphs = False
        self.decoder = DecodeStep(self.model, self.batch, self._routing, cuda_graphs=graphs)
        """The decode step (forward + sampling + bookkeeping, one host copy); see decode.py."""
        self._lock = threading.Condition()
        self._waiting: deque[Group] = deque()
        self._aborted: set[str] = set()
        self._pending_update: (
            tuple[int, dict[str, torch.Tensor], concurrent.futures.Future] | None
        ) = None
        self.error: BaseException | None = None
        """Why the engine can no longer serve (None while it can); see `healthy`."""
        self._seed_rng = torch.Generator().manual_seed(int(time.time_ns() % (1 << 62)))
        self._closed = False
        # Counters for benchmarks and profiles: mean decode batch = decode_rows / decode_steps;
        # forward_s / step_s = share of engine-thread time spent inside model forwards.
        self.stats: dict[str, float] = dict.fromkeys(
            ("decode_steps", "decode_rows", "prefill_tokens", "forward_s", "step_s"), 0
        )
        # Prompt tokens looked up in the prefix cache / served from it (hit rate = hit / query).
        self.stats.update(
            dict.fromkeys(("prefix_cache_query_tokens", "prefix_cache_hit_tokens"), 0)
        )
        self._thread = threading.Thread(target=self._loop, name="slipstream-engine", daemon=True)
        self._thread.start()

    # ---- public API -------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_slots(self) -> int:
        return self.batch.cache.num_slots

    @property
    def num_waiting(self) -> int:
        """Requests (groups) submitted and not yet admitted to KV cache slots."""
        return len(self._waiting)

    @property
    def max_seq_len(self) -> int:
        return self.batch.cache.slot_len

    @property
    def healthy(self) -> bool:
        """The engine thread runs and the weights are intact (False after close)."""
        return not self._closed and self.error is None and self._thread.is_alive()

    @property
    def moe_layout(self) -> tuple[int, int]:
        """(MoE layers, experts per token) of the routing `Completion.routed_experts` holds."""
        return self._routing.num_layers, self._routing.k

    def submit(self, request: GenerateRequest) -> concurrent.futures.Future:
        """Queue one request; the future resolves to its n completions. Raises ValueError at once
        for a request that can never run (prompt too long, n larger than the engine's slots)."""
        self.validate(request)
        future: concurrent.futures.Future = concurrent.futures.Future()

        def deliver(completions: list[Completion]) -> None:
            if not future.done():
                future.set_result(completions)

        def fail(error: Exception) -> None:
            if not future.done():
                future.set_exception(error)

        p = request.params
        seed = (
            p.seed
            if p.seed is not None
            else int(torch.randint(0, 1 << 62, (1,), generator=self._seed_rng))
        )
        group = Group(
            request.request_id, request.prompt_ids, p, seed, deliver, fail, time.perf_counter()
        )
        group.results = [None] * p.n
        group.remaining = p.n
        group.stream = request.stream
        with self._lock:
            self._check_serving()
            if p.max_new_tokens == 0 and not p.wants_prefill_outputs:
                self._finish_empty(group, "length")
            else:
                self._waiting.append(group)
                self._lock.notify_all()
        return future

    def _check_serving(self) -> None:
        if self._closed:
            raise RuntimeError("engine is closed")
        if self.error is not None or not self._thread.is_alive():
            raise RuntimeError(f"engine is not serving: {self.error or 'its thread ended'}")

    def validate(self, request: GenerateRequest) -> None:
        """ValueError (naming the request and the field) for a request this engine can never
        run: a prompt that does not fit, n beyond the slots, ids outside the vocabulary, more
        top-n alternatives than the vocabulary has, routing from a model without MoE layers."""
        n_prompt, vocab = len(request.prompt_ids), self.model.config.vocab_size
        if n_prompt >= self.max_seq_len:
            raise ValueError(
                f"request {request.request_id}: prompt of {n_prompt} tokens does not fit the "
                f"context of {self.max_seq_len} tokens (prompt + at least one new token)"
            )
        if request.params.n > self.num_slots:
            raise ValueError(
                f"request {request.request_id}: n={request.params.n} samples exceed the engine's "
                f"{self.num_slots} KV slots"
            )
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"request {request.request_id}: token ids {bad[:5]} outside [0, {vocab})"
            )
        p = request.params
        for name, n in (("top_logprobs", p.top_logprobs), ("prompt_logprobs", p.prompt_logprobs)):
            if n is not None and n > vocab:
                raise ValueError(
                    f"request {request.request_id}: {name}={n} exceeds the vocabulary ({vocab})"
                )
        if p.return_routed_experts and self._routing.num_layers == 0:
            raise ValueError(
                f"request {request.request_id}: return_routed_experts: the model has no MoE layers"
            )

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        futures = [self.submit(r) for r in requests]
        return [c for f in futures for c in f.result()]

    async def agenerate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        futures = [asyncio.wrap_future(self.submit(r)) for r in requests]
        return [c for cs in await asyncio.gather(*futures) for c in cs]

    def abort(self, request_id: str) -> None:
        with self._lock:
            for g in list(self._waiting):
                if g.request_id == request_id:
                    self._waiting.remove(g)
                    self._finish_empty(g, "abort")
            self._aborted.add(request_id)
            self._lock.notify_all()

    def abort_all(self) -> None:
        """Abort every waiting and running request."""
        with self._lock:
            for g in list(self._waiting):
                self._finish_empty(g, "abort")
            self._waiting.clear()
            self._aborted.update(r.group.request_id for r in self.batch.rows)
            self._lock.notify_all()

    def update_weights(self, version: int, source: WeightSource) -> None:
        """Swap weights (blocking until applied under the configured policy). The source is read
        and validated on this thread first (`weights.prepare_weights`): ValueError/OSError naming
        the problem, with the old weights still serving. `version` must be an integer in
        [0, MAX_VERSION]; ordering rules (monotonic versions) are the caller's (the server's)."""
        check_int("weight version", version, 0, MAX_VERSION)
        self._check_serving()
        self.swap_weights(
            version, prepare_weights(self.model, source, self.config.max_weight_source_bytes)
        )

    def swap_weights(self, version: int, prepared: PreparedWeights, exchange: bool = False) -> None:
        """Put an already prepared version in between decode steps, blocking until applied
        (`update_weights` without its reading and checking: for a receiver that staged and
        checked the version itself, engine/weight_transport.py). `exchange`: swap storages
        with `prepared` instead of copying (`weights.exchange_weights`: `prepared` then holds
        the previous version) unless CUDA graphs read the parameters' addresses, where it copies."""
        version = check_int("weight version", version, 0, MAX_VERSION)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._check_serving()
            if self._pending_update is not None:
                raise RuntimeError("another weight update is in progress")
            self._pending_update = (version, prepared, exchange, future)
            self._lock.notify_all()
        future.result()

    def load_version(self, version: int, weights: PublishedWeights) -> None:
        """update_weights with the version's tensors from the store (checked against its
        manifest); FileNotFoundError when the store no longer holds it."""
        self.update_weights(version, weights.fetch(version))

    def wait_ready(self, timeout_s: float) -> None:
        """In-process: ready once constructed, unless closed or broken (see `healthy`)."""
        if not self.healthy:
            raise RuntimeError(f"native engine is not serving: {self.error or 'closed'}")

    def flush_cache(self) -> bool:
        """Drop the prefix cache (at the engine thread's next use); True."""
        if self.prefix_cache is not None:
            self.prefix_cache.request_clear()
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout=30)

    def __enter__(self) -> NativeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        try:
            while self._iterate():
                pass
        finally:
            with self._lock:
                if not self._closed and self.error is None:
                    self.error = RuntimeError("the engine thread ended unexpectedly")
                    log.error("engine thread ended unexpectedly")
                self._fail_pending(RuntimeError(f"engine stopped: {self.error or 'closed'}"))

    def _iterate(self) -> bool:
        """One scheduling decision and one step; False once closed."""
        with self._lock:
            while not self._closed and not self._has_work():
                self._lock.wait()
            if self._closed:
                for g in self._waiting:
                    self._finish_empty(g, "abort")
                self._waiting.clear()
                self._finish_rows(list(range(len(self.batch))), "abort")
                return False
            try:
                admitted = self._schedule()
            except Exception as e:  # noqa: BLE001 - the engine thread must fail the waiters, not die silently
                log.exception("engine scheduling failed")
                self._fail_all(e)
                return True
        try:
            with torch.inference_mode():
                self._step(admitted)
        except Exception as e:  # noqa: BLE001 - the engine thread must fail the waiters, not die silently
            log.exception("engine step failed")
            self._fail_all(e)
        return True

    def _fail_pending(self, error: Exception) -> None:
        """Under the lock: fail every request and a pending weight update (engine stopping)."""
        if self._pending_update is not None:
            future = self._pending_update[3]
            self._pending_update = None
            if not future.done():
                future.set_exception(error)
        self._fail_all(error)

    def _has_work(self) -> bool:
        return bool(self._waiting or len(self.batch) or self._pending_update or self._aborted)

    def _schedule(self) -> list[Group]:
        """Under the lock: apply a weight update when its policy allows, drop aborted rows, and
        pick the waiting groups that fit in the free slots (FIFO, no overtaking, except that a
        group whose prompt starts like one admitted now waits one step for its prefix to be
        cached: `_wait_for_prefix`)."""
        if self._pending_update is not None:
            policy = self.config.weight_update_policy
            if policy == "abort":
                self._finish_rows(list(range(len(self.batch))), "abort")
            if policy != "finish_old" or len(self.batch) == 0:
                self._apply_update()
            else:
                return []  # finish_old: let the running rows drain before swapping
        if self._aborted:
            doomed = [
                i for i, r in enumerate(self.batch.rows) if r.group.request_id in self._aborted
            ]
            self._finish_rows(doomed, "abort")
            self._aborted.clear()
        admitted: list[Group] = []
        free = self.batch.free_slots
        held: list[Group] = []  # wait one step for a prefix admitted now (keep their order)
        while self._waiting and self._waiting[0].params.n <= free:
            g = self._waiting.popleft()
            if self._wait_for_prefix(g, admitted):
                held.append(g)
                continue
            free -= g.params.n
            admitted.append(g)
        self._waiting.extendleft(reversed(held))
        return admitted

    def _apply_update(self) -> None:
        """Copy validated weights in. A failure here would leave the model part-updated: the
        engine then stops serving (`error`), failing this update and every request."""
        assert self._pending_update is not None
        version, prepared, exchange, future = self._pending_update
        self._pending_update = None
        try:
            if exchange and not self.decoder.cuda_graphs:
                exchange_weights(self.model, prepared)
            else:
                apply_weights(self.model, prepared)
        except (ValueError, RuntimeError) as e:
            self.error = RuntimeError(f"weight copy failed part-way, weights corrupt: {e}")
            log.error("%s", self.error)
            future.set_exception(self.error)
            self._fail_all(self.error)
            return
        self._version = version
        if self.prefix_cache is not None:
            self.prefix_cache.clear()  # KV of the old weights
        self.batch.version_1.fill_(version)
        self.decoder.weights_updated()
        future.set_result(None)

    def _step(self, admitted: list[Group]) -> None:
        t0 = time.perf_counter()
        if admitted:
            self._mixed_step(admitted)
        elif len(self.batch):
            self._decode_step()
        self.stats["step_s"] += time.perf_counter() - t0

    def _decode_step(self) -> None:
        """One token for every running row: `DecodeStep` (a [B, 1] forward, sampling and
        bookkeeping on the device, one host copy)."""
        batch = self.batch
        num = len(batch)
        before_s = self.decoder.forward_s
        out = self.decoder(num)
        self.stats["forward_s"] += self.decoder.forward_s - before_s
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += num
        self._after_sampling(out)

    def _mixed_step(self, groups: list[Group]) -> None:
        """One ragged [1, T] forward: a decode token for every running row, then each admitted
        prompt once (group prefix sharing: its KV is then copied to the group's other slots)."""
        batch, dev = self.batch, self.device
        num_running = len(batch)
        parts: list[Part] = []  # each group's prompt, prefilled once into its first slot
        # per group: (first slot, offset, new tokens, GDN snapshot point, snapshot row)
        spans: list[tuple[int, int, int, int, int]] = []
        offset = num_running
        for g in groups:
            stop_ids = frozenset(g.params.stop_token_ids) | (
                frozenset() if g.params.ignore_eos else self.eos_token_ids
            )
            rows = [batch.add(Row(g, i, stop_ids), len(g.prompt_ids)) for i in range(g.params.n)]
            hit = self._load_prefix(g, rows[0])
            at, snap = (0, -1) if self.prefix_cache is None else (
                self.prefix_cache.snapshot_point(g.prompt_ids, hit))  # fmt: skip
            length = len(g.prompt_ids) - hit
            if snap >= 0:  # GDN models: split the prefill where the prefix cache keeps states
                parts.append(Part(rows[0], offset, at - hit, hit, snap))
                parts.append(Part(rows[0], offset + at - hit, len(g.prompt_ids) - at, at))
            else:
                parts.append(Part(rows[0], offset, length, hit))
            spans.append((rows[0], offset, length, at, snap))
            offset += length
            if g.params.top_logprobs:
                batch.ensure_top(g.params.top_logprobs)
            if g.params.return_routed_experts:
                batch.ensure_routing(self._routing.num_layers, self._routing.k, self._routing.dtype)
        batch.params()
        pos_B = batch.pos_N[:num_running]
        ids = [batch.last_N[:num_running]] + [
            torch.tensor(g.prompt_ids[g.cached_tokens :], device=dev) for g in groups
        ]
        pos = [pos_B] + [torch.arange(p.start, p.start + p.length, device=dev) for p in parts]
        max_pos = batch.max_pos(num_running) if num_running else -1
        batch.cache.begin_mixed(pos_B, max_pos, parts)
        t0 = time.perf_counter()
        logits_1TV, route_TLk = engine_forward(self.model, self._routing, torch.cat(ids)[None],
                                               torch.cat(pos)[None], batch.cache,
                                               batch.any_routing)  # fmt: skip
        self.stats["forward_s"] += time.perf_counter() - t0
        logits_TV = logits_1TV[0]
        self.stats["decode_steps"] += 1 if num_running else 0
        self.stats["decode_rows"] += num_running
        self.stats["prefill_tokens"] += offset - num_running
        batch.pos_N[:num_running] += 1
        batch.advance_host(num_running)
        if route_TLk is not None and num_running:
            batch.record_routing(route_TLk[:num_running])
        # Logits per row: running rows' own, then each new row gets its prompt's last position.
        pick = list(range(num_running))
        for g, (first, off, length, at, snap) in zip(groups, spans, strict=True):
            batch.cache.copy_prefix(
                first, torch.arange(first + 1, first + g.params.n, device=dev), len(g.prompt_ids)
            )
            pc = self.prefix_cache
            if pc is not None and pc.needs_snapshots:  # the blocks up to the saved states
                pc.store(g.prompt_ids, first, at, snap)
            elif pc is not None:
                pc.store(g.prompt_ids, first, len(g.prompt_ids))
            pick += [off + length - 1] * g.params.n
            if g.params.return_routed_experts and route_TLk is not None:
                g.prompt_routing_PLk = route_TLk[off : off + length].clone()
            if g.params.prompt_logprobs is not None:
                set_prompt_logprobs(g, logits_TV[off : off + length - 1])
        logits_RV = logits_TV[torch.tensor(pick, device=dev)]
        batch.fill_uniforms(num_running)
        rows = len(batch)
        tokens_R, logprobs_R = sample_rows(batch, logits_RV, batch.params_for(rows), rows)
        self._after_sampling(to_host(tokens_R, logprobs_R, batch.done_mask(0, tokens_R)))

    def _load_prefix(self, g: Group, slot: int) -> int:
        """Copy the prompt's cached leading blocks into `slot`; the tokens served from cache
        (0 without a prefix cache, or for requests that need every prompt position)."""
        pc = self.prefix_cache
        if pc is None or g.params.prompt_logprobs is not None or g.params.return_routed_experts:
            return 0
        hit, blocks = pc.lookup(g.prompt_ids)
        pc.load(blocks, slot)
        g.cached_tokens = hit
        self.stats["prefix_cache_query_tokens"] += len(g.prompt_ids)
        self.stats["prefix_cache_hit_tokens"] += hit
        return hit

    def _wait_for_prefix(self, g: Group, admitted: list[Group]) -> bool:
        """Hold `g` one step when a group admitted now shares its first prefix-cache block."""
        pc, p = self.prefix_cache, g.params
        if pc is None or not admitted or p.prompt_logprobs is not None or p.return_routed_experts:
            return False
        return pc.worth_waiting(g.prompt_ids, [a.prompt_ids for a in admitted])

    def _store_prefix(self, i: int) -> None:
        """Cache row i's sequence (prompt + tokens whose KV is in its slot) when all of its KV
        came from the weights now serving (versions only grow, so its tokens' versions say)."""
        pc, batch = self.prefix_cache, self.batch
        if pc is None or pc.needs_snapshots:  # GDN states are at the sequence end: not stored
            return
        n = int(batch.gen_N[i])
        if n == 0 or bool((batch.out_ver_NS[i, :n] != self._version).any()):
            return
        g = batch.rows[i].group
        length = int(batch.pos_N[i])
        pc.store(g.prompt_ids + batch.out_tok_NS[i, : length - len(g.prompt_ids)].tolist(), i,
                 length)  # fmt: skip

    def _after_sampling(self, out: StepOutput) -> None:
        """Host side of a step, from its one host copy: stream events, then finish the rows
        that hit a stop token or a limit, or whose text now holds a stop string."""
        if self.batch.stream_rows:
            for group, event in stream_events(self.batch, out.tokens, out.logprobs, self._version):
                self._emit(group, event)
        self._finish_done(out)

    def _emit(self, group: Group, event: StreamEvent) -> None:
        """Call a request's stream hook; if it raises, that request alone is aborted."""
        hook = group.stream
        if hook is None:
            return
        try:
            hook(event)
        except Exception:  # noqa: BLE001 - a client's hook must not fail the other requests
            log.exception("stream hook of request %s failed; aborting it", group.request_id)
            group.stream = None
            with self._lock:
                self._aborted.add(group.request_id)

    def _finish_done(self, out: StepOutput) -> None:
        batch, done = self.batch, out.done
        batch.params()  # refresh stop_string_rows
        matched: dict[int, str] = {}
        if self.tokenizer is not None:
            for i in batch.stop_string_rows:
                row = batch.rows[i]
                row.sampled.append(out.tokens[i])
                if i in done:
                    continue
                text = self.tokenizer.decode(row.sampled)
                hit = next((s for s in row.group.params.stop if s in text), None)
                if hit is not None:
                    matched[i] = hit
                    done.append(i)
        if done:
            with self._lock:
                self._finish_rows(done, None, matched)

    def _finish_rows(
        self, indices: list[int], reason: str | None, matched: dict[int, str] | None = None
    ) -> None:
        """Build completions for rows and free their slots. reason None: derive stop/length."""
        matched = matched or {}
        for i in indices:
            self._store_prefix(i)
            out = self.batch.take(i)
            row, g = out.row, out.row.group
            tokens, logprobs, versions, top = out.tokens, out.logprobs, out.versions, out.top
            stop: int | str | None = matched.get(i)
            why = reason
            if g.params.max_new_tokens == 0:  # ran for prompt outputs only: drop its token
                tokens, logprobs, versions = [], [], []
                top = [] if top is not None else None
                why, stop = reason or "length", None
            if why is None:
                if stop is not None:
                    why = "stop"
                elif tokens and tokens[-1] in row.stop_ids:
                    why, stop = "stop", tokens[-1]
                else:
                    why = "length"
            text = self._text(tokens, stop if isinstance(stop, str) else None)
            c = Completion(
                g.request_id, row.index, g.prompt_ids, tokens, text, logprobs,
                why, versions, stop,  # type: ignore[arg-type]
                top_logprobs=top, prompt_logprobs=g.prompt_logprobs,
                prompt_top_logprobs=g.prompt_top,
                routed_experts=completion_routing(g, out.decode_routing_CLk, len(tokens)),
            )  # fmt: skip
            self._deliver(g, c)
        self.batch.remove(indices)

    def _text(self, tokens: list[int], stop_str: str | None) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(tokens)
        if stop_str is not None:
            text = text[: text.find(stop_str)]
        return text

    def _deliver(self, group: Group, c: Completion) -> None:
        c.meta["e2e_latency_s"] = time.perf_counter() - group.start_s
        c.meta["cached_tokens"] = group.cached_tokens
        self._emit(group, StreamEvent(c.index, completion=c))
        group.results[c.index] = c
        group.remaining -= 1
        if group.remaining == 0:
            group.deliver(group.results)

    def _finish_empty(self, group: Group, reason: str) -> None:
        top: list[Any] | None = [] if group.params.top_logprobs else None
        for i in range(group.params.n):
            if group.results[i] is None:
                c = Completion(
                    group.request_id, i, group.prompt_ids, [], "", [], reason, [],  # type: ignore[arg-type]
                    top_logprobs=top,
                )  # fmt: skip
                self._deliver(group, c)

    def _fail_all(self, error: Exception) -> None:
        """A forward failed: fail every running and waiting request, keep the engine usable."""
        if self.prefix_cache is not None:  # GDN snapshots reserved by the failed step
            self.prefix_cache.release_reserved()
        with self._lock:
            groups = {id(r.group): r.group for r in self.batch.rows}
            groups.update({id(g): g for g in self._waiting})
            self._waiting.clear()
            self.batch.remove(list(range(len(self.batch))))
        for g in groups.values():
            g.fail(RuntimeError(f"engine step failed: {type(error).__name__}: {error}"))
