"""`[engine]`: the rollout inference engine (native in-process, or HTTP to our server/SGLang/vLLM)."""

from typing import Literal

from pydantic import Field

from slipstream.config.base import Section


class EngineConfig(Section):
    type: Literal["native", "http"] = "native"
    """`native`: slipstream's in-process engine. `http`: a server speaking SGLang's native API."""
    url: str | None = None
    """Base URL of the server when type = "http" (e.g. http://127.0.0.1:30000)."""
    max_batch_size: int = Field(default=64, ge=1)
    """Most sequences decoded together."""
    kv_cache_tokens: int = Field(default=16384, ge=64)
    """KV-cache budget in tokens (all running sequences together); the scheduler admits within it."""
    max_new_tokens: int = Field(default=32, ge=1)
    """Default completion length cap."""
