"""Wire formats of the HTTP server: SGLang's native `/generate` family and OpenAI `/v1/completions`.

Field names follow SGLang (python/sglang/srt/managers/io_struct.py `GenerateReqInput`,
`UpdateWeightFromDiskReqInput`; python/sglang/srt/sampling/sampling_params.py `SamplingParams`;
finish reasons from managers/schedule_batch.py `FINISH_*.to_json()`). Unknown fields are rejected
(extra="forbid") so a typo is a 400, not a silently ignored knob. Fields SGLang accepts but
slipstream does not implement are accepted at their neutral value and rejected otherwise.

slipstream additions: `meta_info.output_token_versions` (policy version of each output token).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from slipstream.engine.base import ALL_TOKENS, Completion, SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# SGLang sampling fields slipstream does not implement, with the value that means "off".
_NEUTRAL = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
    "custom_params": None,
}


class SGLSamplingParams(_Strict):
    """SGLang's `sampling_params` object (the subset slipstream implements, plus neutral ones)."""

    max_new_tokens: int | None = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = ALL_TOKENS
    min_p: float = 0.0
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    stream_interval: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    stop_regex: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None

    def to_params(self, default_max_new_tokens: int) -> SamplingParams:
        """Raises ValueError naming an unsupported or out-of-range field."""
        for name, neutral in _NEUTRAL.items():
            if getattr(self, name) != neutral:
                raise ValueError(f"sampling_params.{name} is not supported by slipstream's engine")
        if self.no_stop_trim:
            raise ValueError("sampling_params.no_stop_trim is not supported by slipstream's engine")
        max_new = default_max_new_tokens if self.max_new_tokens is None else self.max_new_tokens
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.sampling_seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=tuple(stop),
            max_new_tokens=max_new,
            n=self.n,
            ignore_eos=self.ignore_eos,
        )


class GenerateReqInput(_Strict):
    """SGLang `POST /generate` body. One of text / input_ids; a list of either is a batch."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SGLSamplingParams | list[SGLSamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False


class UpdateWeightFromDiskReqInput(_Strict):
    """SGLang `POST /update_weights_from_disk` body. `weight_version` must parse as an integer
    here (slipstream versions are integers); absent, the version is incremented."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0


class AbortReqInput(_Strict):
    """SGLang `POST /abort_request` body."""

    rid: str = ""
    abort_all: bool = False


class CompletionRequest(_Strict):
    """OpenAI `POST /v1/completions` body (plus the top_k/min_p/stop_token_ids/ignore_eos
    extensions that SGLang and vLLM accept, and vLLM's return_tokens_as_token_ids)."""

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16)
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    echo: bool = False
    stream: bool = False
    user: str | None = None
    top_k: int = ALL_TOKENS
    min_p: float = 0.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    return_tokens_as_token_ids: bool = False
    """vLLM extension: logprobs.tokens as "token_id:N" strings."""

    def to_params(self, default_max_new_tokens: int) -> SamplingParams:
        if self.stream or self.echo:
            raise ValueError("stream and echo are not supported by slipstream's server")
        if self.frequency_penalty or self.presence_penalty:
            raise ValueError("frequency_penalty / presence_penalty are not supported")
        if self.logprobs is not None and self.logprobs > 1:
            raise ValueError("logprobs > 1 (top alternatives) is not supported; use 0 or 1")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=tuple(stop),
            max_new_tokens=default_max_new_tokens if self.max_tokens is None else self.max_tokens,
            n=self.n,
            ignore_eos=self.ignore_eos,
        )


def finish_reason_json(c: Completion) -> dict[str, Any]:
    """SGLang's FINISH_MATCHED_TOKEN / FINISH_MATCHED_STR / FINISH_LENGTH / FINISH_ABORT JSON."""
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.matched_stop}
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids)}
    return {"type": "abort", "message": c.meta.get("abort_message", "aborted")}


def generate_output(
    c: Completion, rid: str, return_logprob: bool, token_text: Any, current_version: int
) -> dict[str, Any]:
    """One SGLang `/generate` output object for one sample."""
    version = c.versions[-1] if c.versions else current_version
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason_json(c),
        "prompt_tokens": len(c.prompt_ids),
        "completion_tokens": len(c.token_ids),
        # Samples after the first of a group reuse the group's prefill.
        "cached_tokens": len(c.prompt_ids) if c.index > 0 else 0,
        "weight_version": str(version),
        "e2e_latency": c.meta.get("e2e_latency_s", 0.0),
        "output_token_versions": c.versions,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, token_text(tok)] for lp, tok in zip(c.logprobs, c.token_ids, strict=True)
        ]
    return {"text": c.text, "output_ids": c.token_ids, "meta_info": meta}
