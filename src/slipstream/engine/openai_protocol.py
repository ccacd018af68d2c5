"""Wire formats of the HTTP server's OpenAI-compatible endpoints: `/v1/completions` and
`/v1/chat/completions` requests, and the logprob objects of their responses.

Requests follow OpenAI's API reference (plus the extensions SGLang and vLLM accept: top_k,
min_p, stop_token_ids, ignore_eos, vLLM's return_tokens_as_token_ids and add_generation_prompt).
Fields OpenAI defines but slipstream does not implement are accepted at their neutral value and
refused otherwise with a 400 naming them; unknown fields are refused too, except in a chat
message (vLLM passes a message's extra fields and custom roles to the chat template).

Logprob semantics (raw vs processed): a generated token's own logprob (`token_logprobs`, chat
`logprob`) is *processed*: under the distribution it was sampled from (after temperature, top-k,
top-p, min-p: the behaviour logprob the RL trainer uses); a greedy token's is the raw one. Its top
alternatives (`top_logprobs`) are *raw*: the model's n most likely tokens (log_softmax of the
logits, no temperature or filters), as vLLM's default `logprobs_mode="raw_logprobs"` and SGLang's
`top_logprobs_num`, so temperature 0 with logprobs = 5 lists 5 tokens. Completions'
`top_logprobs` start with the position's own token, at its `token_logprobs` value, then the n
(n or n + 1 entries; `logprobs = 0` gives one per token, as vLLM). Echoed
prompt tokens' logprobs and alternatives are raw (nothing was sampled there), each prompt
position lists the prompt token itself; the first prompt token has none (None).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from slipstream.engine.base import ALL_TOKENS, MAX_INT32, MAX_SAMPLES
from slipstream.engine.protocol import Count, Seed, Strict, TokenId, TopN, refuse_long_lists

Stop = str | list[str] | None


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(Strict):
    """Fields common to completions and chat completions."""

    model: str | None = None
    """The served model's name; None or "" means it (vLLM)."""
    temperature: float = 1.0
    top_p: float = 1.0
    n: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] = 1
    stop: Stop = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # extensions (SGLang, vLLM)
    top_k: Annotated[int, Field(ge=ALL_TOKENS, le=MAX_INT32)] = ALL_TOKENS
    min_p: float = 0.0
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    return_tokens_as_token_ids: bool = False
    """vLLM extension: logprobs tokens as "token_id:N" strings."""
    return_routed_experts: bool = False
    """slipstream extension (SGLang's /generate field): the MoE routing of every input position
    on each choice (`routed_experts`, `routed_experts_layout`)."""
    prompt_logprobs: TopN | None = None
    """vLLM extension: each prompt token's logprob and n raw alternatives (`prompt_logprobs`
    of the choice, completions; of the response, chat)."""

    def unsupported(self) -> list[str]:
        """Names of fields set to something slipstream does not implement."""
        bad = []
        if self.frequency_penalty or self.presence_penalty:
            bad.append("frequency_penalty / presence_penalty")
        if self.logit_bias:
            bad.append("logit_bias")
        return bad

    def sampling_kwargs(self) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return dict(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, stop_token_ids=tuple(self.stop_token_ids or ()), stop=tuple(stop),
            n=self.n, ignore_eos=self.ignore_eos,
        )  # fmt: skip


class CompletionRequest(_Sampling):
    """OpenAI `POST /v1/completions` body."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Count | None = 16
    logprobs: TopN | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        return refuse_long_lists(data, ("prompt",))

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.suffix:
            bad.append("suffix")
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of (other than n)")
        return bad


class ChatMessage(BaseModel):
    """One chat message. As vLLM: any role (the chat template decides what a custom one means)
    and any extra field (`reasoning_content`, `tool_calls`, `tool_call_id`, a framework's own),
    passed to the template as given."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    role: Annotated[str, Field(min_length=1, max_length=256)]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def template_fields(self) -> dict[str, Any]:
        """What the chat template gets: the extra fields, then role, content (text), name."""
        out: dict[str, Any] = {**(self.model_extra or {}), "role": self.role,
                               "content": self.text()}  # fmt: skip
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self) -> str:
        """The message's text; content parts must all be text."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        out = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages: content part of type {part.get('type')!r} is not "
                                 "supported (text only)")  # fmt: skip
            out.append(part["text"])
        return "".join(out)


class ChatCompletionRequest(_Sampling):
    """OpenAI `POST /v1/chat/completions` body."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: TopN | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    """vLLM extension: render the template's assistant prefix."""

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.tools:
            bad.append("tools")
        if self.tool_choice not in (None, "none", "auto"):
            bad.append("tool_choice")
        if self.response_format not in (None, {"type": "text"}):
            bad.append("response_format (other than text)")
        if self.top_logprobs and not self.logprobs:
            bad.append("top_logprobs without logprobs=true")
        return bad

    def max_new_tokens(self, default: int) -> int:
        for value in (self.max_completion_tokens, self.max_tokens):
            if value is not None:
                return value
        return default


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[float | None],
    tops: list[list[tuple[int, float]] | None] | None,
    token_str: Callable[[int], str],
    start_offset: int = 0,
) -> dict[str, Any]:
    """The legacy completions `logprobs` object: tokens, token_logprobs, top_logprobs (a dict
    token -> logprob per position, None when not asked for), text_offset."""
    texts = [token_str(t) for t in token_ids]
    offsets, pos = [], start_offset
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    top = None
    if tops is not None:
        top = [
            None if alts is None else {token_str(t): lp for t, lp in alts}
            for alts in tops
        ]  # fmt: skip
    return {
        "tokens": texts,
        "token_logprobs": logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprob_entries(
    token_ids: list[int],
    logprobs: list[float],
    tops: list[list[tuple[int, float]]] | None,
    token_str: Callable[[int], str],
) -> list[dict[str, Any]]:
    """Chat `logprobs.content` entries: token, logprob, bytes (UTF-8), top_logprobs."""

    def entry(t: int, lp: float) -> dict[str, Any]:
        s = token_str(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    out = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        e = entry(t, lp)
        e["top_logprobs"] = [entry(a, alp) for a, alp in tops[i]] if tops is not None else []
        out.append(e)
    return out
