"""What the HTTP server's endpoints share (engine/server.py's SGLang routes and
engine/openai_api.py's OpenAI routes): the engine, the tokenizer, the options, the request
runner and the weight-update lock."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

from fastapi import HTTPException

from slipstream.engine.base import Completion, GenerateRequest
from slipstream.engine.guard import ServeOptions
from slipstream.engine.native import NativeEngine
from slipstream.engine.routing import encode_routed_experts
from slipstream.engine.streaming import Runner
from slipstream.engine.weight_versions import WeightVersions


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
        self.moe_layer_ids = list(engine.model.moe_layer_ids)
        self.num_experts = cfg.num_experts
        self.default_max_new = engine.config.max_new_tokens
        self.versions = WeightVersions()
        # /get_model_info's model_path: the served name (the directory stays private) until an
        # update loads another source, then that source, as SGLang reports it.
        self.reported_model_path = options.served_model_name

    def weight_source(self, model_path: str) -> str:
        """What an update's model_path loads: the served name means the directory the server
        started from (SGLang's revert flow posts back /get_model_info's model_path)."""
        if model_path == self.options.served_model_name and self.model_path:
            return self.model_path
        return model_path

    def encode(self, text: str) -> list[int]:
        """A text prompt as the tokenizer defines it (its post-processor: BOS for slipstream's
        char vocabulary, whatever an HF tokenizer declares)."""
        if self.tokenizer is None:
            raise ValueError("this server has no tokenizer: send token ids instead of text")
        return self.tokenizer.encode_prompt(text)

    def token_text(self, tok: int) -> str:
        return self.tokenizer.decode([tok]) if self.tokenizer is not None else ""

    def text_of(self, ids: list[int], skip_special: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def decode(self) -> Any:
        return self.tokenizer.decode if self.tokenizer is not None else None

    def prompt_details(self, cached: int) -> int | None:
        """The cached prompt tokens an OpenAI usage object reports: None (the field omitted)
        unless the server was asked for them, as vLLM's `--enable-prompt-tokens-details`."""
        return cached if self.options.enable_prompt_tokens_details else None

    def check_model(self, name: str | None) -> None:
        """404 for another model's name; no name or "" means the served one (vLLM)."""
        if name and name != self.options.served_model_name:
            raise HTTPException(404, f"model {name[:200]!r} does not exist "
                                     f"(this server serves {self.options.served_model_name!r})")  # fmt: skip

    def check_batch(self, requests: list[GenerateRequest]) -> None:
        total = sum(r.params.n for r in requests)
        if total > self.options.max_batch_samples:
            raise HTTPException(413, f"request asks for {total} samples (prompts x n); the "
                                     f"limit is {self.options.max_batch_samples}")  # fmt: skip

    def check_context(self, requests: list[GenerateRequest], field: str) -> None:
        """vLLM's rule for a max-token count the client gave: prompt + `field` must fit the
        context (the engine would otherwise cap the completion silently); ValueError (400)
        naming the field."""
        limit = self.engine.max_seq_len
        for r in requests:
            total = len(r.prompt_ids) + r.params.max_new_tokens
            if total > limit:
                raise ValueError(
                    f"{field}: this model's maximum context length is {limit} tokens, the request "
                    f"asks for {total} ({len(r.prompt_ids)} in the prompt, "
                    f"{r.params.max_new_tokens} in the completion); lower {field} or the prompt"
                )

    def fit_context(self, requests: list[GenerateRequest]) -> list[GenerateRequest]:
        """Requests whose max-token count is the server's default: capped at what the context
        leaves after the prompt (vLLM's default), so usage never exceeds the context."""
        out = []
        for r in requests:
            room = max(1, self.engine.max_seq_len - len(r.prompt_ids))
            if r.params.max_new_tokens > room:
                r = GenerateRequest(r.prompt_ids, replace(r.params, max_new_tokens=room),
                                    r.request_id, r.stream)  # fmt: skip
            out.append(r)
        return out

    def check_stop_token_ids(self, requests: list[GenerateRequest]) -> None:
        """ValueError (400) for stop_token_ids outside the vocabulary (vLLM refuses them)."""
        vocab = self.engine.model.config.vocab_size
        for r in requests:
            bad = [t for t in r.params.stop_token_ids if t >= vocab]
            if bad:
                raise ValueError(f"stop_token_ids: {bad[:5]} outside the vocabulary [0, {vocab})")

    def check_prompt_count(self, raw: Any) -> None:
        """413 before anything is tokenized or built: each prompt is at least one sample, so
        more prompts than the sample limit can be refused by the raw list's length alone.
        `raw`: a request's prompt field (one string, one token list, or a list of either)."""
        batched = isinstance(raw, list) and bool(raw) and isinstance(raw[0], (str, list))
        num_prompts = len(raw) if batched else 1  # a string is one prompt, never its characters
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
