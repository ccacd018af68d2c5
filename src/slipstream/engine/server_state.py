"""What the HTTP server's endpoints share (engine/server.py's SGLang routes and
engine/openai_api.py's OpenAI routes): the engine, the tokenizer, the options, the request
runner and the weight-update lock."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import HTTPException

from slipstream.engine.base import Completion, GenerateRequest
from slipstream.engine.guard import ServeOptions
from slipstream.engine.native import NativeEngine
from slipstream.engine.routing import encode_routed_experts
from slipstream.engine.streaming import Runner


class ServerState:
    """What the endpoints share: engine, tokenizer, options, the runner, the update lock."""

    def __init__(
        self, engine: NativeEngine, tokenizer: Any, model_path: str, options: ServeOptions
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.options = options
        self.runner = Runner(engine)
        self.update_lock = asyncio.Lock()
        self.created = int(time.time())
        cfg = engine.model.config
        self.num_hidden_layers = cfg.num_hidden_layers
        self.moe_layer_ids = list(getattr(engine.model, "moe_layer_ids", []))
        self.num_experts = cfg.num_experts
        self.default_max_new = engine.config.max_new_tokens

    def encode(self, text: str) -> list[int]:
        """A text prompt as the tokenizer defines it (its post-processor: BOS for slipstream's
        char vocabulary, whatever an HF tokenizer declares)."""
        if self.tokenizer is None:
            raise ValueError("this server has no tokenizer: send token ids instead of text")
        return self.tokenizer.encode_prompt(text)

    def token_text(self, tok: int) -> str:
        return self.tokenizer.decode([tok]) if self.tokenizer is not None else ""

    def text_of(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def decode(self) -> Any:
        return self.tokenizer.decode if self.tokenizer is not None else None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.options.served_model_name:
            raise HTTPException(404, f"model {name[:200]!r} does not exist "
                                     f"(this server serves {self.options.served_model_name!r})")  # fmt: skip

    def check_batch(self, requests: list[GenerateRequest]) -> None:
        total = sum(r.params.n for r in requests)
        if total > self.options.max_batch_samples:
            raise HTTPException(413, f"request asks for {total} samples (prompts x n); the "
                                     f"limit is {self.options.max_batch_samples}")  # fmt: skip

    def check_prompt_count(self, num_prompts: int) -> None:
        """413 before anything is tokenized or built: each prompt is at least one sample, so
        more prompts than the sample limit can be refused by the raw list's length alone."""
        if num_prompts > self.options.max_batch_samples:
            raise HTTPException(413, f"request asks for at least {num_prompts} samples (one per "
                                     f"prompt); the limit is {self.options.max_batch_samples}")  # fmt: skip

    def routed(self, c: Completion, start: int) -> tuple[str | None, dict[str, Any] | None]:
        """SGLang's base64 routing of rows [start, P + C - 1) and slipstream's layout extra."""
        if c.routed_experts is None:
            return None, None
        rows = c.routed_experts[min(start, c.routed_experts.shape[0]) :]
        data = encode_routed_experts(rows, self.moe_layer_ids, self.num_hidden_layers)
        layout = {"shape": [rows.shape[0], self.num_hidden_layers, rows.shape[2]],
                  "moe_layers": self.moe_layer_ids, "num_experts": self.num_experts}  # fmt: skip
        return data, layout
