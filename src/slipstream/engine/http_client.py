"""`Engine` over HTTP: slipstream's own server, SGLang (native `/generate`) or vLLM (OpenAI
`/v1/completions` with token ids).

One background event loop owns an `httpx.AsyncClient` (connection pool); `generate` (sync) and
`agenerate` (async, from any event loop) both run there. Concurrency is bounded by a semaphore;
connection errors and 5xx answers are retried with exponential backoff; 4xx answers and exhausted
retries raise `EngineHTTPError` with the status and the server's message.

api="sglang": POST /generate with input_ids, sampling_params (SGLang names) and
return_logprob=True; versions come from meta_info.output_token_versions (slipstream) or
meta_info.weight_version (SGLang) when it parses as an integer, else -1. Requests that ask for
them also get top-n logprobs (`top_logprobs_num`), prompt logprobs (`logprob_start_len=0`) and
MoE routing (`return_routed_experts`: SGLang's base64 int32 (P + C - 1, num_hidden_layers, k)
in meta_info.routed_experts, decoded into `Completion.routed_experts` (P + C - 1, L_moe, k) in
the compact dtype, exactly as the native engine returns it). Decoding needs the layout: from
`model_config` (the served model's `ModelConfig`: layers, MoE layers, k, experts), else from
slipstream's `routed_experts_layout` extra (shape, MoE layer ids, number of experts).
api="openai": POST /v1/completions with token-id prompts, logprobs=0 and vLLM's
return_tokens_as_token_ids so token ids come back exactly; versions are -1 (unknown). The model
name is `model`, else the first id /v1/models lists.

Authentication: `api_key` (default: $SLIPSTREAM_API_KEY) is sent as `Authorization: Bearer` on
every request, as `slipstream serve --api-key`, SGLang and vLLM expect.

What the logprobs mean is the server's business: slipstream's are behaviour logprobs after all
sampling processing; other servers may report them before top-k/top-p processing.
Not covered: streaming, update_weights / load_version on api="openai" (vLLM has no standard
endpoint), routing and prompt logprobs on api="openai".
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx

from slipstream.engine.base import ALL_TOKENS, Completion, GenerateRequest, PublishedWeights
from slipstream.engine.routing import decode_routed_experts, routing_dtype

API_KEY_ENV = "SLIPSTREAM_API_KEY"

log = logging.getLogger(__name__)


class EngineHTTPError(RuntimeError):
    """The server answered with an error (or could not be reached after retries)."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class HTTPEngine:
    """Client `Engine` for a server at `url` (e.g. http://127.0.0.1:30000)."""

    def __init__(
        self,
        url: str,
        api: str = "sglang",
        max_concurrency: int = 64,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.25,
        model: str | None = None,
        version: int = 0,
        stage_dir: str | Path | None = None,
        api_key: str | None = None,
        model_config: Any = None,
        served_version: bool = False,
    ) -> None:
        """`version`: what the client assumes the server holds until update_weights (-1: unknown,
        so a RolloutWorker's first weight sync loads the store's latest version into it).
        `stage_dir`: for `load_version`, a local directory the *server* can read, owned by this
        client alone, into which each version is copied from the store before the server is
        told to load it (the server cannot read the store: SGLang and an s3:// store). None:
        the server is given the store's own location.
        `api_key`: Bearer key (default $SLIPSTREAM_API_KEY; "" for none). `model_config`: the
        served model's `ModelConfig`, to decode routing from servers that send no shape.
        `served_version`: the server's weights change without this client (the trainer pushes
        them: engine.weight_sync = "distributed"), so `version` is what the server reports it
        serves (`/get_model_info`'s weight_version), not what this client last loaded."""
        if api not in ("sglang", "openai"):
            raise ValueError(f"api must be 'sglang' or 'openai', got {api!r}")
        self.url = url.rstrip("/")
        self.api = api
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.model = model
        self._version = version
        self.stage_dir = Path(stage_dir).resolve() if stage_dir is not None else None
        key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
        self.api_key: str | None = key or None
        """The Bearer key this client sends (None: none)."""
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.served_version = served_version
        self.model_config = model_config
        self._group_sizes: dict[str, int] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="http-engine", daemon=True
        )
        self._thread.start()
        self._client: httpx.AsyncClient | None = None
        self._sem: asyncio.Semaphore | None = None
        self._call(self._setup())

    async def _setup(self) -> None:
        limits = httpx.Limits(
            max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency
        )
        self._client = httpx.AsyncClient(
            limits=limits, timeout=httpx.Timeout(self.timeout_s), headers=self._headers
        )
        self._sem = asyncio.Semaphore(self.max_concurrency)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _spawn(self, coro: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # ---- Engine protocol ----------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The version this client last loaded into the server, or (`served_version`) the one
        the server reports now: a decimal `weight_version` is the integer version, a free-form
        label (SGLang's default "default") is -1, unknown. A server that cannot be asked keeps
        the last answer (the next weight sync asks again)."""
        if self.served_version:
            try:
                self._version = served_weight_version(self.get_model_info())
            except (EngineHTTPError, ValueError) as e:  # unreachable, or not JSON
                log.warning("%s: weight version unknown (%s); assuming %d", self.url, e,
                            self._version)  # fmt: skip
        return self._version

    def submit(self, request: GenerateRequest) -> Future:
        """One request on the client's event loop; the future resolves to its completions."""
        return self._spawn(self._generate_all([request]))

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        return self._call(self._generate_all(list(requests)))

    async def agenerate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        return await asyncio.wrap_future(self._spawn(self._generate_all(list(requests))))

    def update_weights(self, version: int, source: Any) -> None:
        """`source` must be a directory path the *server* can read (HF format)."""
        if self.api != "sglang":
            raise RuntimeError(
                f"HTTPEngine(api={self.api!r}) cannot update weights: the OpenAI API (vLLM) has "
                "no weight-update endpoint; use api='sglang' (slipstream serve, SGLang)"
            )
        if not isinstance(source, str | Path):
            raise TypeError(
                "HTTPEngine.update_weights takes a checkpoint directory path, not tensors"
            )
        body = {"model_path": str(source), "weight_version": str(version)}
        out = self._call(self._post("/update_weights_from_disk", body))
        if not out.get("success", False):
            raise EngineHTTPError(f"update_weights_from_disk failed: {out.get('message')}")
        self._version = version

    def load_version(self, version: int, weights: PublishedWeights) -> None:
        """Tell the server to load `version` by location: the store's own, or a manifest-checked
        copy under stage_dir (copied under a temporary name, then renamed, so the server never
        sees a partial copy; older copies in stage_dir are removed after the switch).
        FileNotFoundError when the store no longer holds the version."""
        if self.stage_dir is None:
            try:
                self.update_weights(version, weights.location(version))
            except EngineHTTPError:
                if version not in weights.versions():  # retention removed it meanwhile
                    raise FileNotFoundError(weights.location(version)) from None
                raise
            return
        staged = self.stage_dir / f"v{version:08d}"
        if not staged.is_dir():
            partial = self.stage_dir / f".partial-v{version:08d}"
            shutil.rmtree(partial, ignore_errors=True)
            weights.fetch_to_dir(version, str(partial))
            partial.rename(staged)
        self.update_weights(version, str(staged))
        for old in self.stage_dir.glob("v*"):
            if old.name < staged.name:  # v%08d sorts by version
                shutil.rmtree(old, ignore_errors=True)

    def abort(self, request_id: str) -> None:
        n = self._group_sizes.get(request_id, 1)
        rids = [request_id] if n == 1 else [f"{request_id}_{i}" for i in range(n)] + [request_id]
        for rid in rids:
            self._call(self._post("/abort_request", {"rid": rid}, expect_json=False))

    def flush_cache(self) -> None:
        self._call(self._post("/flush_cache", {}, expect_json=False))

    def wait_ready(self, timeout_s: float, poll_s: float = 1.0) -> None:
        """Block until GET /health answers 200 (our server and SGLang both serve it); a server
        that is still starting (connection refused, 503) is waited for. EngineHTTPError naming
        the URL and the last answer after timeout_s."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while True:
            try:
                resp = httpx.get(
                    f"{self.url}/health", timeout=max(poll_s, 1.0), headers=self._headers
                )
                if resp.status_code == 200:
                    return
                last = f"HTTP {resp.status_code}"
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise EngineHTTPError(
                    f"{self.url}/health: server not ready within {timeout_s} s ({last})"
                )
            time.sleep(poll_s)

    def get_model_info(self) -> dict[str, Any]:
        return self._call(self._request("GET", "/get_model_info", None))

    def close(self) -> None:
        if self._client is not None:
            self._call(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> HTTPEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests -----------------------------------------------------------------------------

    async def _generate_all(self, requests: list[GenerateRequest]) -> list[Completion]:
        one = self._generate_sglang if self.api == "sglang" else self._generate_openai
        groups = await asyncio.gather(*(one(r) for r in requests))
        return [c for g in groups for c in g]

    async def _generate_sglang(self, r: GenerateRequest) -> list[Completion]:
        p = r.params
        sp: dict[str, Any] = {
            "max_new_tokens": p.max_new_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            "min_p": p.min_p,
            "n": p.n,
            "ignore_eos": p.ignore_eos,
        }
        if p.stop:
            sp["stop"] = list(p.stop)
        if p.stop_token_ids:
            sp["stop_token_ids"] = list(p.stop_token_ids)
        if p.seed is not None:
            sp["sampling_seed"] = p.seed
        body: dict[str, Any] = {
            "input_ids": r.prompt_ids,
            "sampling_params": sp,
            "return_logprob": True,
            "rid": r.request_id,
        }
        if p.top_logprobs or p.prompt_logprobs:
            body["top_logprobs_num"] = max(p.top_logprobs, p.prompt_logprobs or 0)
        if p.prompt_logprobs is not None:
            body["logprob_start_len"] = 0
        if p.return_routed_experts:
            body["return_routed_experts"] = True
        self._group_sizes[r.request_id] = p.n
        try:
            out = await self._post("/generate", body)
        finally:
            self._group_sizes.pop(r.request_id, None)
        outs = out if isinstance(out, list) else [out]
        if len(outs) != p.n:
            raise EngineHTTPError(f"/generate returned {len(outs)} outputs for n={p.n}")
        return [self._parse_sglang(r, i, o) for i, o in enumerate(outs)]

    def _parse_sglang(self, r: GenerateRequest, index: int, out: dict[str, Any]) -> Completion:
        meta = out.get("meta_info", {})
        lp_items = meta.get("output_token_logprobs") or []
        ids = out.get("output_ids")
        tokens = [int(t) for t in ids] if ids is not None else [int(x[1]) for x in lp_items]
        logprobs = [float(x[0]) if x[0] is not None else float("nan") for x in lp_items]
        versions = meta.get("output_token_versions")
        if versions is None:
            wv = meta.get("weight_version")
            v = int(wv) if isinstance(wv, str) and wv.lstrip("-").isdigit() else -1
            versions = [v] * len(tokens)
        finish = meta.get("finish_reason") or {"type": "abort"}
        reason = finish.get("type", "abort")
        if reason not in ("stop", "length", "abort"):
            reason = "abort"
        p = r.params
        top = prompt_lp = prompt_top = routed = None
        if p.top_logprobs:
            top = [_pairs(alts)[: p.top_logprobs] for alts in meta.get("output_top_logprobs", [])]
        if p.prompt_logprobs is not None:
            items = meta.get("input_token_logprobs") or []
            prompt_lp = [None if x[0] is None else float(x[0]) for x in items]
            if prompt_lp:
                prompt_lp[0] = None
            if p.prompt_logprobs:
                prompt_top = [
                    None if alts is None or j == 0 else _pairs(alts)[: p.prompt_logprobs]
                    for j, alts in enumerate(meta.get("input_top_logprobs") or [])
                ]
        if p.return_routed_experts:
            routed = self._routing(meta, len(r.prompt_ids) + len(tokens) - 1)
        return Completion(
            r.request_id, index, r.prompt_ids, tokens, out.get("text", ""), logprobs, reason,
            [int(v) for v in versions], finish.get("matched"), {"meta_info": meta},
            top_logprobs=top, prompt_logprobs=prompt_lp, prompt_top_logprobs=prompt_top,
            routed_experts=routed,
        )  # fmt: skip

    def _routing(self, meta: dict[str, Any], num_rows: int) -> Any:
        """meta_info.routed_experts as (rows, L_moe, k); EngineHTTPError if it cannot be."""
        data = meta.get("routed_experts")
        if not isinstance(data, str):
            raise EngineHTTPError(
                f"{self.url}: return_routed_experts asked for, but the response has no "
                "meta_info.routed_experts (SGLang needs --enable-return-routed-experts)"
            )
        cfg = self.model_config
        try:
            if cfg is not None:
                from slipstream.model.transformer import is_moe_layer

                layers = cfg.num_hidden_layers
                moe = [i for i in range(layers) if is_moe_layer(cfg, i)]
                return decode_routed_experts(data, num_rows, layers, cfg.num_experts_per_tok, moe,
                                             routing_dtype(cfg.num_experts))  # fmt: skip
            layout = meta.get("routed_experts_layout")
            if not isinstance(layout, dict):
                raise ValueError(
                    "the server sent no routed_experts_layout: give HTTPEngine(model_config=...)"
                )
            rows, layers, k = (int(x) for x in layout["shape"])
            if rows != num_rows:
                raise ValueError(f"{rows} rows for {num_rows} input positions")
            moe = [int(i) for i in layout["moe_layers"]]
            dtype = routing_dtype(int(layout["num_experts"]))
            return decode_routed_experts(data, rows, layers, k, moe, dtype)
        except (ValueError, KeyError, TypeError) as e:
            raise EngineHTTPError(f"{self.url}: cannot decode routed_experts: {e!r}") from None

    async def _model_name(self) -> str:
        if self.model is None:
            listing = await self._request("GET", "/v1/models", None)
            self.model = str(listing["data"][0]["id"])
        return self.model

    async def _generate_openai(self, r: GenerateRequest) -> list[Completion]:
        p = r.params
        body: dict[str, Any] = {
            "model": await self._model_name(),
            "prompt": r.prompt_ids,
            "max_tokens": p.max_new_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "n": p.n,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        if p.top_k != ALL_TOKENS:
            body["top_k"] = p.top_k
        if p.min_p:
            body["min_p"] = p.min_p
        if p.stop:
            body["stop"] = list(p.stop)
        if p.stop_token_ids:
            body["stop_token_ids"] = list(p.stop_token_ids)
        if p.seed is not None:
            body["seed"] = p.seed
        if p.ignore_eos:
            body["ignore_eos"] = True
        out = await self._post("/v1/completions", body)
        completions = []
        for i, ch in enumerate(sorted(out["choices"], key=lambda c: c["index"])):
            tokens = ch.get("token_ids")
            lp = ch.get("logprobs") or {}
            if tokens is None:
                tokens = [int(str(t).removeprefix("token_id:")) for t in lp.get("tokens", [])]
            logprobs = [float(x) for x in lp.get("token_logprobs", [])]
            reason = ch.get("finish_reason") or "abort"
            versions = ch.get("token_versions") or [-1] * len(tokens)
            completions.append(
                Completion(
                    r.request_id,
                    i,
                    r.prompt_ids,
                    [int(t) for t in tokens],
                    ch.get("text", ""),
                    logprobs,
                    reason if reason in ("stop", "length") else "abort",
                    versions,
                    ch.get("matched_stop"),
                )  # fmt: skip
            )
        return completions

    async def _post(self, path: str, body: dict[str, Any], expect_json: bool = True) -> Any:
        return await self._request("POST", path, body, expect_json)

    async def _request(self, method: str, path: str, body: Any, expect_json: bool = True) -> Any:
        assert self._client is not None and self._sem is not None
        url = self.url + path
        async with self._sem:
            for attempt in range(self.max_retries + 1):
                last = attempt == self.max_retries
                try:
                    resp = await self._client.request(method, url, json=body)
                except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as e:
                    if last:
                        raise EngineHTTPError(
                            f"{method} {url}: {type(e).__name__} after {attempt + 1} attempts: {e}"
                        ) from e
                    log.warning("%s %s: %s, retrying", method, url, type(e).__name__)
                    await asyncio.sleep(self.backoff_s * 2**attempt)
                    continue
                except httpx.TimeoutException as e:
                    raise EngineHTTPError(
                        f"{method} {url}: timed out after {self.timeout_s} s"
                    ) from e
                if resp.status_code >= 500 and not last:
                    log.warning("%s %s: HTTP %d, retrying", method, url, resp.status_code)
                    await asyncio.sleep(self.backoff_s * 2**attempt)
                    continue
                if resp.status_code >= 400:
                    raise EngineHTTPError(
                        f"{method} {url}: HTTP {resp.status_code}: {_error_message(resp)}",
                        resp.status_code,
                    )
                return resp.json() if expect_json else resp.text
        raise AssertionError("unreachable")


def served_weight_version(model_info: dict[str, Any]) -> int:
    """The integer version of a `/get_model_info` answer's `weight_version` (SGLang's and
    `slipstream serve`'s): decimal digits are the version; anything else (a free-form label,
    none) is -1, not known."""
    raw = model_info.get("weight_version") if isinstance(model_info, dict) else None
    text = str(raw).strip() if raw is not None else ""
    return int(text) if text.isdigit() and text.isascii() else -1


def _pairs(alts: Any) -> list[tuple[int, float]]:
    """SGLang [logprob, token_id, text] triples as (token_id, logprob) pairs."""
    return [(int(x[1]), float(x[0])) for x in alts or []]


def _error_message(resp: httpx.Response) -> str:
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in data:
            return str(data["message"])
        if "detail" in data:
            return str(data["detail"])
    return str(data)[:500]
