"""Rollout inference: the `Engine` protocol, slipstream's native continuous-batching engine, an
HTTP server speaking SGLang's native API and OpenAI's /v1 API, and an HTTP client engine.

`engine.server` (FastAPI) is imported only by `slipstream serve`; this package needs torch and
httpx only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import torch

from slipstream.config.engine import EngineConfig
from slipstream.config.model import ModelConfig
from slipstream.engine.base import (
    ALL_TOKENS,
    Completion,
    Engine,
    FinishReason,
    GenerateRequest,
    PublishedWeights,
    SamplingParams,
    StreamEvent,
)
from slipstream.engine.http_client import EngineHTTPError, HTTPEngine
from slipstream.engine.native import NativeEngine
from slipstream.engine.sampling import RowParams, processed_logprobs
from slipstream.engine.weights import load_weights_into


@overload
def build_engine(
    config: EngineConfig,
    model: torch.nn.Module,
    tokenizer: Any = None,
    version: int = 0,
    *,
    eos_token_ids: Sequence[int] | None = None,
) -> NativeEngine: ...


@overload
def build_engine(
    config: EngineConfig,
    model: None = None,
    tokenizer: None = None,
    version: int = 0,
    *,
    stage_dir: str | None = None,
    model_config: ModelConfig | None = None,
) -> HTTPEngine: ...


def build_engine(
    config: EngineConfig,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    version: int = 0,
    *,
    stage_dir: str | None = None,
    model_config: ModelConfig | None = None,
    eos_token_ids: Sequence[int] | None = None,
) -> Engine:
    """The engine named by an `EngineConfig`, the one place an engine is constructed.

    "native" runs `model` in this process (the model is what makes it native, so it returns a
    `NativeEngine` exactly when a model is given); its stop tokens are `eos_token_ids`, else the
    tokenizer's EOS (none without a tokenizer). "http" is a client of the server at
    `config.url`, which holds the model, the tokenizer and the stop tokens; it takes
    `stage_dir`, this client's own directory for staged weight copies (see `HTTPEngine`), when
    the server cannot read the weight store itself, and `model_config` (the served model's
    `ModelConfig`), which decodes routing from an SGLang server; its API key comes from
    $SLIPSTREAM_API_KEY. An argument the chosen engine would not use is refused, not dropped."""
    if config.type == "native":
        if model is None:
            raise ValueError("engine.type = 'native' needs a model")
        if stage_dir is not None or model_config is not None:
            raise ValueError(
                "engine.type = 'native': stage_dir and model_config are for an HTTP client"
            )
        return NativeEngine(
            model, config, tokenizer=tokenizer, version=version, eos_token_ids=eos_token_ids
        )
    if model is not None or tokenizer is not None or eos_token_ids is not None:
        raise ValueError(
            f"engine.type = {config.type!r}: the server holds the model, tokenizer and stop "
            "tokens; model, tokenizer and eos_token_ids are for engine.type = 'native'"
        )
    if not config.url:
        raise ValueError(f"engine.type = {config.type!r} needs engine.url")
    return HTTPEngine(
        config.url,
        max_concurrency=config.max_concurrency,
        timeout_s=config.request_timeout_s,
        max_retries=config.max_retries,
        version=version,
        stage_dir=stage_dir,
        model_config=model_config,
        # the trainer pushes to the server (weight_sync "distributed"): it says what it serves
        served_version=config.weight_sync == "distributed",
    )


__all__ = [
    "ALL_TOKENS",
    "Completion",
    "Engine",
    "EngineHTTPError",
    "FinishReason",
    "GenerateRequest",
    "HTTPEngine",
    "NativeEngine",
    "PublishedWeights",
    "RowParams",
    "SamplingParams",
    "StreamEvent",
    "build_engine",
    "load_weights_into",
    "processed_logprobs",
]
