"""Rollout inference: the `Engine` protocol, slipstream's native continuous-batching engine, an
HTTP server speaking SGLang's native API and OpenAI's /v1 API, and an HTTP client engine.

`engine.server` (FastAPI) is imported only by `slipstream serve`; this package needs torch and
httpx only.
"""

from __future__ import annotations

from typing import Any

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


def build_engine(
    config: Any,
    model: Any = None,
    tokenizer: Any = None,
    version: int = 0,
    stage_dir: str | None = None,
    model_config: Any = None,
) -> Engine:
    """The engine named by an `EngineConfig`: "native" needs `model`; "http" needs `config.url`
    and takes `stage_dir`, this client's own directory for staged weight copies (see
    `HTTPEngine`), when the server cannot read the weight store itself, and `model_config` (the
    served model's `ModelConfig`), which decodes routing from an SGLang server; its API key
    comes from $SLIPSTREAM_API_KEY."""
    if config.type == "native":
        if model is None:
            raise ValueError("engine.type = 'native' needs a model")
        return NativeEngine(model, config, tokenizer=tokenizer, version=version)
    if not config.url:
        raise ValueError("engine.type = 'http' needs engine.url")
    return HTTPEngine(
        config.url,
        max_concurrency=config.max_concurrency,
        timeout_s=config.request_timeout_s,
        max_retries=config.max_retries,
        version=version,
        stage_dir=stage_dir,
        model_config=model_config,
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
