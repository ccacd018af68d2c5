"""The `Engine` contract shared by the native engine and the HTTP client: requests, sampling
parameters, completions.

A request is prompt token ids plus `SamplingParams`; `n` > 1 asks for a GRPO group of n samples of
the same prompt. `generate` returns one `Completion` per sample, in request order and then sample
index order. Every completion carries the behaviour log-probability of each sampled token under
the distribution it was actually sampled from (after temperature, top-k, top-p and min-p), the
finish reason, and the policy version that produced each token.

Not covered here: streaming, top-n alternative logprobs, penalties, grammars.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]
ALL_TOKENS = -1  # top_k value meaning "no top-k filter"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Field names follow SGLang's `sampling_params` except `seed`
    (SGLang: `sampling_seed`).

    temperature 0 means greedy (argmax); its behaviour logprobs are then 0.0 (a point mass), as in
    SGLang, where temperature 0 becomes top_k = 1. top_k = -1 means the whole vocabulary.
    seed None draws a fresh seed per request; the same seed gives the same samples whatever else
    is in the batch. Stop strings end a sample when its decoded text contains one; the text is cut
    before the stop string, the token ids keep the token that completed it."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = ALL_TOKENS
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    max_new_tokens: int = 32
    n: int = 1
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != ALL_TOKENS and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (all) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        # Accept lists from callers but store tuples so the params stay hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenerateRequest:
    """One prompt (token ids) and how to sample it. `request_id` names it for `abort`."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        self.prompt_ids = [int(t) for t in self.prompt_ids]


@dataclass
class Completion:
    """One sample. `logprobs[i]` and `versions[i]` belong to `token_ids[i]`.

    `finish_reason`: "stop" (a stop token id, EOS, or a stop string: `matched_stop` says which),
    "length" (max_new_tokens or the context limit), "abort" (aborted or dropped by a weight update
    under the "abort" policy)."""

    request_id: str
    index: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: FinishReason
    versions: list[int]
    matched_stop: int | str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class PublishedWeights(Protocol):
    """What an engine needs from a store of published policy versions (`storage.WeightStore`
    implements it) to load one: its tensors, a local copy, or where it lives. Each raises
    FileNotFoundError when the version is not (or no longer) published."""

    def fetch(self, version: int) -> dict[str, Any]:
        """The version's state dict (HF parameter names), checked against its manifest."""
        ...

    def fetch_to_dir(self, version: int, local_dir: str) -> str:
        """A checked HF-format copy of the version in local_dir; returns local_dir."""
        ...

    def location(self, version: int) -> str:
        """The version's HF-format directory as a path or URL a server can load from."""
        ...

    def versions(self) -> list[int]:
        """Published versions, ascending."""
        ...


@runtime_checkable
class Engine(Protocol):
    """What a rollout worker needs from an inference engine (in-process or over HTTP). A caller
    never needs to know which one it has: every method below means the same on both.

    Lifecycle: built by `build_engine`; `wait_ready` before the first request (a server may still
    be loading); `close` once, after the last request has finished."""

    @property
    def version(self) -> int:
        """Policy version of the weights new tokens are sampled with (-1: not known yet, e.g. a
        server the client has not told which version to load)."""
        ...

    def submit(self, request: GenerateRequest) -> Future[list[Completion]]:
        """Start one request; the future resolves to its n completions (sample index order) or
        to the error that ended it. Returns at once."""
        ...

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Run the requests to completion; one Completion per sample, request order then index."""
        ...

    async def agenerate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """`generate` for asyncio callers; the engine batches concurrent calls together."""
        ...

    def update_weights(self, version: int, source: Any) -> None:
        """Swap in new weights tagged `version`. `source`: a state dict or an HF-format directory
        (native engine); a directory path or URL the server reads (HTTP engine)."""
        ...

    def load_version(self, version: int, weights: PublishedWeights) -> None:
        """Bring the engine to `version` of a weight store, however this engine loads weights
        (tensors in-process; a location, or a staged local copy, for a server). Raises
        FileNotFoundError when the store no longer holds the version (retention removed it
        meanwhile: ask for the newest version again)."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request: finished samples keep their tokens, finish_reason "abort"."""
        ...

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the engine can serve requests; raise (naming why) after timeout_s."""
        ...

    def close(self) -> None:
        """Release the engine (threads, connections, KV cache). In-flight requests are aborted."""
        ...
