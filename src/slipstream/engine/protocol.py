"""Wire formats of the HTTP server's SGLang-native endpoints (`/generate` family).

Field names follow SGLang (python/sglang/srt/managers/io_struct.py `GenerateReqInput`,
`UpdateWeightFromDiskReqInput`; python/sglang/srt/sampling/sampling_params.py `SamplingParams`;
finish reasons from managers/schedule_batch.py `FINISH_*.to_json()`; logprob tuples and
`routed_experts` from the tokenizer manager's output processing). Unknown fields are rejected
(extra="forbid") so a typo is a 400, not a silently ignored knob. Fields SGLang accepts but
slipstream does not implement are accepted at their neutral value and rejected otherwise. Every
number is bounded here (and again by `SamplingParams`), floats must be finite.

Logprobs: `output_token_logprobs` are the processed (behaviour) logprobs of the sampled tokens
(after temperature and filters; for greedy the raw distribution's, as SGLang's greedy sampler);
`output_top_logprobs` / `input_*` are the raw
distribution's (log_softmax of the logits), as SGLang reports `top_logprobs_num`.
`meta_info.weight_version` is a string label over slipstream's integer versions
(`weight_versions.py`); `meta_info.cached_tokens` counts the prefix cache's hit.

slipstream additions: `meta_info.output_token_versions` (policy version of each output token)
and `meta_info.routed_experts_layout` ({shape: [rows, num_hidden_layers, k], moe_layers,
num_experts}: what a client needs to decode `routed_experts` without the model's config).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from slipstream.engine.base import (
    ALL_TOKENS,
    MAX_INT32,
    MAX_SAMPLES,
    MAX_TOP_LOGPROBS,
    SEED_RANGE,
    Completion,
    SamplingParams,
)

TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
Count = Annotated[int, Field(ge=0, le=MAX_INT32)]
Seed = Annotated[int, Field(ge=SEED_RANGE[0], lt=SEED_RANGE[1])]
TopN = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


MAX_BATCH_PROMPTS = MAX_SAMPLES
"""Most list items (prompts, per-prompt params, rids) one request can carry: the ceiling of every
server's sample limit (`--max-batch-samples`), since each prompt is at least one sample."""


def refuse_long_lists(data: Any, fields: tuple[str, ...]) -> Any:
    """A `mode="before"` check on the raw JSON: a list field longer than MAX_BATCH_PROMPTS is
    refused by its length before a single item is validated (one prompt's token ids are not a
    batch: the context limit bounds them later) (validating 2M nested token lists
    takes seconds on the event loop; tokenizing 2M text prompts took ~24 CPU-s)."""
    if isinstance(data, dict):
        for name in fields:
            value = data.get(name)
            one_prompt = bool(value) and isinstance(value, list) and isinstance(value[0], int)
            if isinstance(value, list) and len(value) > MAX_BATCH_PROMPTS and not one_prompt:
                raise ValueError(f"{name}: {len(value)} items; at most {MAX_BATCH_PROMPTS} "
                                 "per request")  # fmt: skip
    return data


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


class SGLSamplingParams(Strict):
    """SGLang's `sampling_params` object (the subset slipstream implements, plus neutral ones)."""

    max_new_tokens: Count | None = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Annotated[int, Field(ge=ALL_TOKENS, le=MAX_INT32)] = ALL_TOKENS
    min_p: float = 0.0
    n: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: Seed | None = None
    stream_interval: Annotated[int, Field(ge=1, le=MAX_INT32)] | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: Count = 0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    stop_regex: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None

    def to_params(self, default_max_new_tokens: int, **outputs: Any) -> SamplingParams:
        """Raises ValueError naming an unsupported or out-of-range field. `outputs`: the
        optional-output fields of `SamplingParams` the request asks for."""
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
            **outputs,
        )


class GenerateReqInput(Strict):
    """SGLang `POST /generate` body. One of text / input_ids; a list of either is a batch.
    `logprob_start_len` >= 0 (with return_logprob) adds the prompt's logprobs from that position;
    `top_logprobs_num` adds that many alternatives per token; `return_routed_experts` adds the
    MoE routing of positions [routed_experts_start_len, prompt + completion - 1)."""

    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: SGLSamplingParams | list[SGLSamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: Annotated[int, Field(ge=-1, le=MAX_INT32)] = -1
    top_logprobs_num: TopN = 0
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: Count = 0
    stream: bool = False

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        return refuse_long_lists(data, ("text", "input_ids", "sampling_params", "rid",
                                        "return_logprob"))  # fmt: skip


class UpdateWeightFromDiskReqInput(Strict):
    """SGLang `POST /update_weights_from_disk` body. `weight_version`: decimal digits set the
    integer version; any other string is a label of the next integer version; absent, the
    version is incremented (`weight_versions.py`)."""

    model_path: Annotated[str, Field(min_length=1, max_length=4096)]
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: Annotated[str, Field(max_length=4096)] | None = None
    flush_cache: bool = True
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: Count = 0


class UpdateWeightVersionReqInput(Strict):
    """SGLang `POST /update_weight_version` body: relabel the served weights. SGLang's default
    aborts the requests in flight."""

    new_version: Annotated[str, Field(max_length=4096)]
    abort_all_requests: bool = True


class AbortReqInput(Strict):
    """SGLang `POST /abort_request` body."""

    rid: str = ""
    abort_all: bool = False


def finish_reason_json(c: Completion) -> dict[str, Any] | None:
    """SGLang's FINISH_MATCHED_TOKEN / FINISH_MATCHED_STR / FINISH_LENGTH / FINISH_ABORT JSON."""
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.matched_stop}
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids)}
    return {"type": "abort", "message": c.meta.get("abort_message", "aborted")}


# JSON has no -inf: a logprob below this is sent as this (vLLM's convention).
MIN_LOGPROB = -9999.0


def finite(lp: float | None) -> float | None:
    """`lp` clamped to >= MIN_LOGPROB (None stays None), so a response always encodes."""
    return None if lp is None else max(lp, MIN_LOGPROB)


def logprob_tuples(
    pairs: list[tuple[float | None, int]], token_text: Callable[[int], str | None] | None
) -> list[list[Any]]:
    """SGLang's [logprob, token_id, text] triples (text None unless return_text_in_logprobs)."""
    return [[finite(lp), tok, token_text(tok) if token_text else None] for lp, tok in pairs]


def generate_output(
    c: Completion,
    rid: str,
    obj: GenerateReqInput,
    return_logprob: bool,
    token_text: Callable[[int], str | None],
    current_version: int,
    routed_experts: str | None = None,
    routed_layout: dict[str, Any] | None = None,
    version_label: Callable[[int], str] = str,
) -> dict[str, Any]:
    """One SGLang `/generate` output object for one sample. `version_label`: the string
    `meta_info.weight_version` reports for an integer version (`weight_versions.py`)."""
    version = c.versions[-1] if c.versions else current_version
    text_fn = token_text if obj.return_text_in_logprobs else None
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason_json(c),
        "prompt_tokens": len(c.prompt_ids),
        "completion_tokens": len(c.token_ids),
        # Prompt tokens not prefilled for this sample: the prefix cache's hit (engine meta),
        # and all of them for samples after the first of a group (they copy its prefill).
        "cached_tokens": len(c.prompt_ids) if c.index > 0 else c.meta.get("cached_tokens", 0),
        "weight_version": version_label(version),
        "e2e_latency": c.meta.get("e2e_latency_s", 0.0),
        "output_token_versions": c.versions,
    }
    if return_logprob:
        meta["output_token_logprobs"] = logprob_tuples(
            list(zip(c.logprobs, c.token_ids, strict=True)), text_fn
        )
        if obj.top_logprobs_num and c.top_logprobs is not None:
            meta["output_top_logprobs"] = [
                logprob_tuples([(lp, t) for t, lp in alts], text_fn) for alts in c.top_logprobs
            ]
        if obj.logprob_start_len >= 0 and c.prompt_logprobs is not None:
            start = min(obj.logprob_start_len, len(c.prompt_ids))
            meta["input_token_logprobs"] = logprob_tuples(
                list(zip(c.prompt_logprobs, c.prompt_ids, strict=True))[start:], text_fn
            )
            if obj.top_logprobs_num and c.prompt_top_logprobs is not None:
                meta["input_top_logprobs"] = [
                    None if alts is None else logprob_tuples([(lp, t) for t, lp in alts], text_fn)
                    for alts in c.prompt_top_logprobs[start:]
                ]
    if routed_experts is not None:
        meta["routed_experts"] = routed_experts
        meta["routed_experts_layout"] = routed_layout
    return {"text": c.text, "output_ids": c.token_ids, "meta_info": meta}
