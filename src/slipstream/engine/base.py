"""The `Engine` contract shared by the native engine and the HTTP client: requests, sampling
parameters, completions.

A request is prompt token ids plus `SamplingParams`; `n` > 1 asks for a GRPO group of n samples of
the same prompt. `generate` returns one `Completion` per sample, in request order and then sample
index order. Every completion carries the behaviour log-probability of each sampled token under
the distribution it was actually sampled from (after temperature, top-k, top-p and min-p), the
finish reason, and the policy version that produced each token. On request it also carries the
top-n alternatives of each token and the prompt's logprobs, both under the model's raw
distribution (log_softmax of the logits, no temperature or filters: what SGLang's
`top_logprobs_num` and vLLM's default `raw_logprobs` mode report),
and the MoE routing of every input position (`routed_experts`). A request may stream: its
`stream` hook gets a `StreamEvent` per token and one per finished sample.

Every numeric field is bounded here (`SamplingParams.__post_init__`), so no value reaches the
engine's int64/float32 tensors unchecked; the engine adds the bounds that depend on the model
(vocabulary, slots, context) in `validate`.

Not covered here: penalties, grammars, logit bias.
"""

from __future__ import annotations

import math
import operator
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "abort"]
ALL_TOKENS = -1  # top_k value meaning "no top-k filter"
# Bounds of every numeric request field (ints become int64 tensors; a value outside these never
# reaches the engine). Policy versions are trainer step counts: 2**31 - 1 is unreachable.
MAX_INT32 = 2**31 - 1
MAX_VERSION = MAX_INT32
MIN_TEMPERATURE = 1e-6  # below this (and above 0) logits / T overflow float32; use 0 (greedy)
MAX_TEMPERATURE = 1e6
MAX_TOP_LOGPROBS = 20  # top-n alternatives per token (OpenAI allows 20 in chat)
MAX_STOP_TOKEN_IDS = 256
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
MAX_SAMPLES = 2**16  # n; the engine also bounds it by its KV slots
SEED_RANGE = (-(2**63), 2**64)  # seeds are hashed modulo 2**60


def check_int(name: str, value: Any, low: int, high: int) -> int:
    """`value` as an int in [low, high]; ValueError naming the field and the value otherwise
    (bools and floats are refused: a float would be truncated silently)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)  # ints and integer-like (numpy) values; never floats
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if not low <= value <= high:
        shown = value if abs(value) < 10**30 else f"{str(value)[:20]}... ({len(str(value))} digits)"
        raise ValueError(f"{name} must be in [{low}, {high}], got {shown}")
    return value


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Field names follow SGLang's `sampling_params` except `seed`
    (SGLang: `sampling_seed`).

    temperature 0 means greedy (argmax); its logprobs are then the raw distribution's
    (log_softmax of the logits), as SGLang's greedy sampler and vLLM's `raw_logprobs` report
    them. top_k = -1 means the whole vocabulary.
    seed None draws a fresh seed per request; the same seed gives the same samples whatever else
    is in the batch. Stop strings end a sample when its decoded text contains one; the text is cut
    before the stop string, the token ids keep the token that completed it.

    Optional outputs (off by default; the default path computes none of them):
    `top_logprobs` (0..20) most likely tokens at each sampled position under the model's raw
    distribution (no temperature or filters, so a greedy request still sees n); `prompt_logprobs`
    (None: none; 0: each prompt token's logprob; n: plus n alternatives) under the model's own
    distribution; `return_routed_experts`: the MoE routing of every input position (see
    `Completion.routed_experts`). With any of these, max_new_tokens = 0 still runs the prefill."""

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
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            object.__setattr__(self, name, _as_float(name, getattr(self, name)))
        t = self.temperature
        if not (math.isfinite(t) and (t == 0.0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE)):
            raise ValueError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                f"got {t!r}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k != ALL_TOKENS:
            object.__setattr__(self, "top_k", check_int("top_k", self.top_k, 1, MAX_INT32))
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        check_int("max_new_tokens", self.max_new_tokens, 0, MAX_INT32)
        check_int("n", self.n, 1, MAX_SAMPLES)
        if self.seed is not None:
            check_int("seed", self.seed, SEED_RANGE[0], SEED_RANGE[1] - 1)
        check_int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS)
        # Accept lists from callers but store tuples so the params stay hashable and immutable.
        ids = tuple(self.stop_token_ids)
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids has {len(ids)} entries (at most {MAX_STOP_TOKEN_IDS})"
            )
        ids = tuple(check_int("stop_token_ids entry", t_id, 0, MAX_INT32) for t_id in ids)
        object.__setattr__(self, "stop_token_ids", ids)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(stop)} strings (at most {MAX_STOP_STRINGS})")
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        object.__setattr__(self, "stop", stop)

    @property
    def wants_prefill_outputs(self) -> bool:
        """Prompt logprobs or routing asked for: the prefill must run even for 0 new tokens."""
        return self.prompt_logprobs is not None or self.return_routed_experts

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenerateRequest:
    """One prompt (token ids) and how to sample it. `request_id` names it for `abort`.

    `stream` (optional): called on the native engine's thread with a `StreamEvent` for every
    sampled token of every sample (in order per sample), then one per sample when it finishes
    (`completion` set), before the request's future resolves. It must return quickly and not
    block (hand the event to another thread or event loop); an exception it raises aborts this
    request only. Requests without it take the default path (no per-token Python work)."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    stream: Callable[[StreamEvent], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        name = f"request {self.request_id}: prompt token id"
        self.prompt_ids = [check_int(name, t, 0, MAX_INT32) for t in self.prompt_ids]


@dataclass
class Completion:
    """One sample. `logprobs[i]` and `versions[i]` belong to `token_ids[i]`.

    `finish_reason`: "stop" (a stop token id, EOS, or a stop string: `matched_stop` says which),
    "length" (max_new_tokens or the context limit), "abort" (aborted or dropped by a weight update
    under the "abort" policy).

    Optional outputs (None unless the request's params asked for them):
    `top_logprobs[i]`: (token id, logprob) alternatives of token i, best first.
    `prompt_logprobs[j]`: log p(prompt[j] | prompt[:j]) under the model (None for j = 0);
    `prompt_top_logprobs[j]`: alternatives at prompt position j (None for j = 0).
    `routed_experts`: (P + C - 1, L_moe, k) CPU tensor, uint8 when num_experts <= 256 else
    int16: row j holds the k expert ids each MoE layer (model order) routed input position j to,
    positions 0..P-1 being the prompt (prefill) and P + i - 1 the i-th sampled token fed back
    (the trainer's inputs, seq[:-1]). Row j was computed by the weights of version
    `versions[max(0, j - P + 1)]`; the n samples of a group share their prompt rows."""

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
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    routed_experts: torch.Tensor | None = None


@dataclass(frozen=True)
class StreamEvent:
    """One step of a streaming request's sample `index`: a new token (token_id, its behaviour
    logprob, the weights version that sampled it, its top-n alternatives when asked for), or,
    with `completion` set, the sample's end (the token fields are then unused)."""

    index: int
    token_id: int = -1
    logprob: float = 0.0
    version: int = -1
    top_logprobs: list[tuple[int, float]] | None = None
    completion: Completion | None = None
    prompt_logprobs: list[float | None] | None = None
    """On a sample's first token event, when the request asked for prompt logprobs."""
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


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
