"""The running batch of the native engine: per-row state as tensors, kept compacted.

Row i of the batch lives in KV slot i. When a row finishes, the last row moves into its place
(its KV prefix and every per-row tensor), so rows [0, B) are always the live ones and a decode
step needs no gather. Output tokens, behaviour logprobs and versions are written into per-row
buffers with one indexed store per step; Python touches a row only when it joins, finishes, or
has stop strings to check.

Optional per-row outputs live in buffers allocated on first use, so requests that do not ask for
them cost nothing: top-n alternatives of each sampled token (`top_ids_NSW`, `top_lp_NSW`) and the
MoE routing of each decode step's input token (`route_NSLk`). Prompt-side outputs (prompt
logprobs, the prefill's routing) are computed once per group and kept on the `Group`.

Legend: N slots (most rows), B live rows, S slot length, W stop-token width (or top-n width for
the top-logprob buffers), L MoE layers, k experts per token, P prompt tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from slipstream.engine.base import SamplingParams
from slipstream.engine.kv_cache import SlotKVCache
from slipstream.engine.sampling import RowParams, counter_uniform


@dataclass
class Group:
    """One request in the engine: its n samples and where to deliver them."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    deliver: Callable[[list[Any]], None]  # gets the n Completions, on the engine thread
    fail: Callable[[Exception], None]  # the engine could not run the request
    start_s: float
    results: list[Any] = field(default_factory=list)
    remaining: int = 0
    stream: Callable[[Any], None] | None = None  # per-token StreamEvent hook (engine thread)
    prompt_routing_PLk: torch.Tensor | None = None  # prefill routing, shared by the n samples
    prompt_logprobs: list[float | None] | None = None  # prompt_logprobs[j]: logp of prompt[j]
    prompt_top: list[list[tuple[int, float]] | None] | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (engine/prefix_cache.py)


@dataclass
class RowOutput:
    """What a finished row produced (read by `RunningBatch.take`)."""

    row: Row
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    top: list[list[tuple[int, float]]] | None  # per token, finite alternatives, best first
    decode_routing_CLk: torch.Tensor | None  # routing of the fed tokens 0..C-2 (device tensor)


@dataclass
class Row:
    group: Group
    index: int  # sample index within the group
    stop_ids: frozenset[int]
    sampled: list[int] = field(default_factory=list)
    """The row's tokens so far on the host, kept only for rows with stop strings (from each
    step's one host copy), so their text is checked without reading the device."""
    streamed: int = 0
    """Tokens streamed so far (streaming rows only): its generated count, known on the host."""


class RunningBatch:
    """Per-row tensors for up to `num_slots` rows, plus the KV cache they index.

    _normal: buffers allocated while the engine steps (under torch.inference_mode) are made
    with inference mode off, so they stay normal tensors: the scheduler updates them in place
    outside inference mode (row removal), which inference tensors refuse."""

    def __init__(self, cache: SlotKVCache, vocab_size: int, device: torch.device | str) -> None:
        n, s = cache.num_slots, cache.slot_len
        self.cache = cache
        self.vocab_size = vocab_size
        self.device = device
        self.rows: list[Row] = []
        self.pos_N = torch.zeros(n, dtype=torch.int64, device=device)  # tokens stored in KV
        self.gen_N = torch.zeros(n, dtype=torch.int64, device=device)  # tokens generated
        self.last_N = torch.zeros(n, dtype=torch.int64, device=device)  # token to feed next
        self.max_new_N = torch.zeros(n, dtype=torch.int64, device=device)
        self.stop_NW = torch.full((n, 4), -1, dtype=torch.int64, device=device)
        self.out_tok_NS = torch.zeros((n, s), dtype=torch.int64, device=device)
        self.out_lp_NS = torch.zeros((n, s), dtype=torch.float32, device=device)
        self.out_ver_NS = torch.zeros((n, s), dtype=torch.int64, device=device)
        self.u_NS = torch.zeros((n, s), dtype=torch.float32, device=device)  # sampling uniforms
        self._rows_N = torch.arange(n, device=device)
        self.version_1 = torch.zeros(1, dtype=torch.int64, device=device)
        """The policy version of the weights serving (a device tensor: a captured decode graph
        reads it; the engine updates it in place at a weight swap)."""
        # Sampling parameters of rows [0, N) in persistent buffers (`params_for`): the rows'
        # values copied in at each composition change, so a captured graph reads current ones.
        self._temperature_N = torch.ones(n, dtype=torch.float32, device=device)
        self._top_k_N = torch.full((n,), vocab_size, dtype=torch.int64, device=device)
        self._top_p_N = torch.ones(n, dtype=torch.float32, device=device)
        self._min_p_N = torch.zeros(n, dtype=torch.float32, device=device)
        self._greedy_N = torch.zeros(n, dtype=torch.bool, device=device)
        # Host mirror of the rows' KV positions, so a step's key span needs no device read:
        # row i's position is _pos_base[i] + _steps (`advance_host`, `max_pos`).
        self._pos_base: list[int] = []
        self._steps = 0
        self.layout_version = 0
        """Bumped when a per-row buffer is reallocated (captured graphs hold the old ones)."""
        self._params: RowParams | None = None
        self.stop_string_rows: list[int] = []
        # Derived from the composition with the params (see `params`).
        self.stream_rows: list[int] = []  # rows whose request streams tokens
        self.top_width = 0  # most top-n alternatives any live row wants (0: none)
        self.any_routing = False  # some live row records MoE routing
        # Lazily allocated optional outputs.
        self.top_ids_NSW: torch.Tensor | None = None
        self.top_lp_NSW: torch.Tensor | None = None
        self.route_NSLk: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def free_slots(self) -> int:
        return self.cache.num_slots - len(self.rows)

    def params(self) -> RowParams:
        """Row sampling parameters, rebuilt only after the composition changed."""
        if self._params is None:
            self._params = RowParams.build(
                [r.group.params for r in self.rows],
                self.vocab_size,
                self.device,
            )
            self.stop_string_rows = [i for i, r in enumerate(self.rows) if r.group.params.stop]
            self.stream_rows = [i for i, r in enumerate(self.rows) if r.group.stream is not None]
            self.top_width = max((r.group.params.top_logprobs for r in self.rows), default=0)
            self.any_routing = any(r.group.params.return_routed_experts for r in self.rows)
            num, rp = len(self.rows), self._params
            for static, live in (
                (self._temperature_N, rp.temperature_B), (self._top_k_N, rp.top_k_B),
                (self._top_p_N, rp.top_p_B), (self._min_p_N, rp.min_p_B),
                (self._greedy_N, rp.greedy_B),
            ):  # fmt: skip
                static[:num] = live
        return self._params

    def params_for(self, rows: int) -> RowParams:
        """`params()` over the persistent buffers, for rows [0, rows) (rows >= the live rows:
        the rest are padding rows of a decode bucket, their values stale but valid)."""
        rp = self.params()
        return RowParams(
            self._temperature_N[:rows], self._top_k_N[:rows], self._top_p_N[:rows],
            self._min_p_N[:rows], self._greedy_N[:rows],
            rp.all_greedy, rp.any_greedy, rp.needs_filter,
        )  # fmt: skip

    def max_pos(self, rows: int) -> int:
        """The largest KV position of rows [0, rows), from the host mirror (no device read)."""
        return max(self._pos_base[:rows]) + self._steps

    def advance_host(self, rows: int) -> None:
        """Rows [0, rows) stored one more token (mirrors `pos_N[:rows] += 1`)."""
        if rows == len(self._pos_base):
            self._steps += 1
        else:
            for i in range(rows):
                self._pos_base[i] += 1

    def step_state(self) -> tuple[torch.Tensor, ...]:
        """The per-row tensors a decode step advances (saved around a graph capture's warm-up)."""
        return (self.pos_N, self.gen_N, self.last_N)

    def ensure_top(self, width: int) -> None:
        """Allocate (or widen) the top-n buffers to hold `width` alternatives per token."""
        if self.top_ids_NSW is not None and self.top_ids_NSW.shape[2] >= width:
            return
        n, s = self.cache.num_slots, self.cache.slot_len
        with torch.inference_mode(False):  # see `_normal`
            ids = torch.zeros((n, s, width), dtype=torch.int64, device=self.device)
            lps = torch.full((n, s, width), float("-inf"), dtype=torch.float32, device=self.device)
        if self.top_ids_NSW is not None and self.top_lp_NSW is not None:
            old = self.top_ids_NSW.shape[2]
            ids[:, :, :old], lps[:, :, :old] = self.top_ids_NSW, self.top_lp_NSW
        self.top_ids_NSW, self.top_lp_NSW = ids, lps
        self.layout_version += 1

    def ensure_routing(self, num_layers: int, k: int, dtype: torch.dtype) -> None:
        """Allocate the per-row routing buffer [N, S, L, k] on first use."""
        if self.route_NSLk is None:
            shape = (self.cache.num_slots, self.cache.slot_len, num_layers, k)
            with torch.inference_mode(False):  # see `_normal`
                self.route_NSLk = torch.zeros(shape, dtype=dtype, device=self.device)
            self.layout_version += 1

    def record_routing(self, route_BLk: torch.Tensor) -> None:
        """Store the routing of this step's input token of rows [0, B): the token sampled at
        the previous step (index gen - 1), i.e. before `record` advances the rows."""
        assert self.route_NSLk is not None
        num = route_BLk.shape[0]
        self.route_NSLk[self._rows_N[:num], self.gen_N[:num] - 1] = route_BLk

    def add(self, row: Row, prompt_len: int) -> int:
        """Append a row (its KV must be written by the caller); returns its index."""
        i = len(self.rows)
        self.rows.append(row)
        stops = sorted(row.stop_ids)
        if len(stops) > self.stop_NW.shape[1]:
            with torch.inference_mode(False):  # see `_normal`
                wider = torch.full(
                    (self.stop_NW.shape[0], len(stops)), -1, dtype=torch.int64, device=self.device
                )
            wider[:, : self.stop_NW.shape[1]] = self.stop_NW
            self.stop_NW = wider
            self.layout_version += 1
        self.stop_NW[i] = -1
        if stops:
            self.stop_NW[i, : len(stops)] = torch.tensor(stops, dtype=torch.int64)
        # max_new_tokens = 0 with prompt outputs requested: the row runs its prefill and samples
        # one token, which the engine then drops (the completion is empty).
        wanted = max(1, row.group.params.max_new_tokens)
        limit = min(wanted, self.cache.slot_len - prompt_len + 1)
        self.max_new_N[i] = limit
        self.pos_N[i] = prompt_len
        self.gen_N[i] = 0
        self._pos_base.append(prompt_len - self._steps)
        self._params = None
        return i

    def fill_uniforms(self, first: int) -> None:
        """Precompute the sampling uniforms of rows [first, B) for every token they may draw."""
        rows = self.rows[first:]
        if not rows:
            return
        steps_S = torch.arange(self.cache.slot_len, device=self.device)
        seeds = [r.group.seed & 0xFFFFFFFFFFFFFFF for r in rows]
        seed_RS = torch.tensor(seeds, device=self.device)[:, None].expand(-1, steps_S.shape[0])
        stream_RS = torch.tensor([r.index for r in rows], device=self.device)[:, None].expand_as(
            seed_RS
        )
        self.u_NS[first : len(self.rows)] = counter_uniform(seed_RS, stream_RS, steps_S[None, :])

    def uniforms(self, num: int) -> torch.Tensor:
        """This step's uniform for rows [0, num)."""
        return self.u_NS[self._rows_N[:num], self.gen_N[:num]]

    def record(
        self,
        first: int,
        tokens_B: torch.Tensor,
        logprobs_B: torch.Tensor,
        version: int | torch.Tensor,
        top: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Store one sampled token for rows [first, first + len(tokens_B)) and advance them.
        `version`: an int or a one-element device tensor (`version_1`). `top`: (ids [B, W'],
        logprobs [B, W']) alternatives, when some row wants them."""
        num = tokens_B.shape[0]
        rows_B = torch.arange(first, first + num, device=tokens_B.device)
        gen_B = self.gen_N[first : first + num]
        self.out_tok_NS[rows_B, gen_B] = tokens_B
        self.out_lp_NS[rows_B, gen_B] = logprobs_B
        self.out_ver_NS[rows_B, gen_B] = version
        if top is not None:
            assert self.top_ids_NSW is not None and self.top_lp_NSW is not None
            width = top[0].shape[1]
            self.top_ids_NSW[rows_B, gen_B, :width] = top[0]
            self.top_lp_NSW[rows_B, gen_B, :width] = top[1]
        self.last_N[first : first + num] = tokens_B
        self.gen_N[first : first + num] += 1

    def done_mask(self, first: int, tokens_B: torch.Tensor) -> torch.Tensor:
        """Rows (from `first`) that hit a stop token, their token limit, or the slot end."""
        end = first + tokens_B.shape[0]
        hit_B = (tokens_B[:, None] == self.stop_NW[first:end]).any(dim=1)
        hit_B |= self.gen_N[first:end] >= self.max_new_N[first:end]
        # The pending token needs a KV position for the next step: none left -> length.
        hit_B |= self.pos_N[first:end] >= self.cache.slot_len
        return hit_B

    def top_of(self, i: int, start: int, end: int) -> list[list[tuple[int, float]]]:
        """Row i's top-n alternatives of tokens [start, end): finite entries, best first."""
        params = self.rows[i].group.params
        if params.top_logprobs == 0 or self.top_ids_NSW is None or self.top_lp_NSW is None:
            return [[] for _ in range(start, end)]
        width = params.top_logprobs
        ids = self.top_ids_NSW[i, start:end, :width].tolist()
        lps = self.top_lp_NSW[i, start:end, :width].tolist()
        inf = float("-inf")
        return [
            [(t, lp) for t, lp in zip(ti, li, strict=True) if lp != inf]
            for ti, li in zip(ids, lps, strict=True)
        ]

    def take(self, i: int) -> RowOutput:
        """Read a row's outputs; the caller then calls `remove`."""
        n = int(self.gen_N[i])
        row = self.rows[i]
        params = row.group.params
        top = self.top_of(i, 0, n) if params.top_logprobs > 0 else None
        routing = None
        if params.return_routed_experts and self.route_NSLk is not None:
            routing = self.route_NSLk[i, : max(n - 1, 0)].clone()
        return RowOutput(
            row,
            self.out_tok_NS[i, :n].tolist(),
            self.out_lp_NS[i, :n].tolist(),
            self.out_ver_NS[i, :n].tolist(),
            top,
            routing,
        )

    def remove(self, indices: list[int]) -> None:
        """Drop rows; the last live row fills each hole (highest index first)."""
        for i in sorted(indices, reverse=True):
            last = len(self.rows) - 1
            if i != last:
                self.cache.move(last, i, self._pos_base[last] + self._steps)
                for t in (self.pos_N, self.gen_N, self.last_N, self.max_new_N):
                    t[i] = t[last]
                for t in (
                    self.stop_NW,
                    self.out_tok_NS,
                    self.out_lp_NS,
                    self.out_ver_NS,
                    self.u_NS,
                    self.top_ids_NSW,
                    self.top_lp_NSW,
                    self.route_NSLk,
                ):
                    if t is not None:
                        t[i] = t[last]
                self.rows[i] = self.rows[last]
                self._pos_base[i] = self._pos_base[last]
            # The freed slot may pad a decode bucket: a valid position, nothing generated.
            for t in (self.pos_N, self.gen_N, self.last_N):
                t[last] = 0
            self.rows.pop()
            self._pos_base.pop()
        if not self.rows:
            self._steps = 0
        if indices:
            self._params = None
