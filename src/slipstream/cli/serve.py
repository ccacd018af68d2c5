"""`slipstream serve --model DIR`: the native engine behind SGLang's native HTTP API and OpenAI's
completions / chat completions / models endpoints. The `[engine]` config section sizes the
engine (KV budget, batch, slot length); the flags below set what the server accepts (see
docs/security.md for what it trusts)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from typing import Any

from slipstream.cli import add_config_args
from slipstream.config import load_config

API_KEY_ENV = "SLIPSTREAM_API_KEY"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over HTTP (SGLang native API + OpenAI /v1 completions and chat)",
        description="Serve an HF-format model directory with slipstream's native engine. Endpoints: "
        "/generate, /update_weights_from_disk, /flush_cache, /abort_request, /get_model_info, "
        "/get_weight_version, /update_weight_version, /health, /health_generate, /metrics, "
        "/v1/completions, /v1/chat/completions, /v1/models; a reward model directory (a "
        "*ForSequenceClassification config.json) serves POST /classify.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="HF-format model directory")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="SPEC",
        help="tokenizer: 'char', a directory or a tokenizer.json (default: the model directory "
        "if it holds one, else none: clients must send token ids)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model id of /v1/models and responses (default: the model directory's name)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on the admin endpoints (weight updates, "
        f"abort, flush; every endpoint but /health with --api-key-scope all). Default: "
        f"${API_KEY_ENV}, else no authentication; an empty key is refused",
    )
    p.add_argument("--api-key-scope", choices=("admin", "all"), default="admin")
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=8 * 2**20,
        help="larger request bodies get 413 (default 8 MiB)",
    )
    p.add_argument(
        "--max-batch-samples",
        type=int,
        default=1024,
        help="most samples (prompts x n) one request may ask for; more get 413",
    )
    p.add_argument(
        "--allow-weight-url-scheme",
        action="append",
        default=[],
        metavar="SCHEME",
        help="also accept weight sources with this URL scheme (default: local paths, file://, "
        "s3://); repeatable",
    )
    p.add_argument(
        "--allow-version-rollback",
        action="store_true",
        help="accept a weight_version below the served one (e.g. a job resumed from an older "
        "checkpoint against this long-lived server)",
    )
    p.add_argument(
        "--weight-version",
        default=None,
        metavar="LABEL",
        help="SGLang's --weight-version: the label the served weights report (weight_version, "
        "/get_weight_version) until an update; default: the integer version (0)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="vLLM's flag: OpenAI usage objects report prompt_tokens_details.cached_tokens "
        "(omitted otherwise, as vLLM); SGLang's meta_info.cached_tokens is always reported",
    )
    p.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="SGLang's flag: no prefix cache. By default serve keeps one of "
        "engine.kv_cache_tokens tokens (as SGLang's radix cache is on by default) unless the "
        "config sets engine.prefix_cache_tokens",
    )
    p.add_argument("--log-level", default="warning")
    add_config_args(p)
    p.set_defaults(func=cmd_serve)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _served_engine_config(engine: Any, disable_radix_cache: bool) -> Any:
    """The engine section this server runs: native (this process is the server, whatever
    engine.type a config shared with the clients names: their "http" points here), with a
    prefix cache unless the config sized one or --disable-radix-cache: SGLang's radix cache is
    on by default, and its clients read meta_info.cached_tokens."""
    update: dict[str, Any] = {"type": "native"}
    if disable_radix_cache:
        update["prefix_cache_tokens"] = 0
    elif "prefix_cache_tokens" not in engine.model_fields_set:
        update["prefix_cache_tokens"] = min(engine.kv_cache_tokens, 2**24)  # the key's bound
    return engine.model_copy(update=update)


def cmd_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    import uvicorn

    from slipstream.engine import build_engine
    from slipstream.engine.base import MAX_SAMPLES
    from slipstream.engine.guard import ServeOptions
    from slipstream.engine.server import create_app
    from slipstream.model import load_pretrained
    from slipstream.model.tokenizer import TOKENIZER_FILE, load_tokenizer

    for flag, value, lo, hi in (("--port", args.port, 1, 65535),
                                ("--max-request-bytes", args.max_request_bytes, 1024, 1 << 30),
                                ("--max-batch-samples", args.max_batch_samples, 1, MAX_SAMPLES)):  # fmt: skip
        if not lo <= value <= hi:  # what a TCP port / the request guard can take
            print(f"slipstream serve: {flag} {value}: must be in [{lo}, {hi}]", file=sys.stderr)
            return 2
    api_key, key_source = args.api_key, "--api-key"
    if api_key is None:
        api_key, key_source = os.environ.get(API_KEY_ENV), f"${API_KEY_ENV}"
    if api_key is not None and not api_key.strip():
        # an unset shell variable (`--api-key "$KEY"`, `SLIPSTREAM_API_KEY=`) must not open the
        # admin routes: no authentication is asked for by leaving both out, never by an empty key
        print(f"slipstream serve: {key_source} is empty: pass a key, or leave out --api-key and "
              f"unset {API_KEY_ENV} to serve without authentication", file=sys.stderr)  # fmt: skip
        return 2
    if api_key is None and args.api_key_scope == "all":
        print(f"slipstream serve: --api-key-scope all needs a key (--api-key or ${API_KEY_ENV})",
              file=sys.stderr)  # fmt: skip
        return 2
    logging.basicConfig(level=args.log_level.upper())
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        print(f"slipstream serve: --model {args.model}: no config.json there (expected an "
              "HF-format model directory)", file=sys.stderr)  # fmt: skip
        return 2
    cfg = load_config(args.config, args.overrides)
    options = ServeOptions(
        served_model_name=args.served_model_name or model_dir.resolve().name,
        api_key=api_key,
        api_key_scope=args.api_key_scope,
        max_request_bytes=args.max_request_bytes,
        max_batch_samples=args.max_batch_samples,
        weight_url_schemes=("file", "s3", *(s.lower() for s in args.allow_weight_url_scheme)),
        allow_version_rollback=args.allow_version_rollback,
        weight_sync_timeout_s=cfg.engine.weight_sync_timeout_s,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
    )
    if options.api_key is None and not _is_loopback(args.host):
        print(
            "\n" + "!" * 78 + f"\nslipstream serve: WARNING: binding {args.host} (beyond loopback) "
            "WITHOUT an API key:\n  anyone who can reach this port can replace the weights, "
            "abort every request\n  and flush the cache. Pass --api-key (or set "
            f"${API_KEY_ENV}).\n" + "!" * 78 + "\n",
            file=sys.stderr,
            flush=True,
        )
    from slipstream.rm.model import is_reward_checkpoint

    if is_reward_checkpoint(model_dir):  # a reward model: POST /classify (rm/server.py)
        from slipstream.rm.server import serve_reward_model

        return serve_reward_model(args.model, args.tokenizer, options, cfg.engine.device,
                                  args.host, args.port, args.log_level)  # fmt: skip
    model = load_pretrained(args.model, device=cfg.engine.device)
    tok_spec = args.tokenizer
    if tok_spec is None and (model_dir / TOKENIZER_FILE).is_file():
        tok_spec = args.model
    tokenizer = load_tokenizer(tok_spec) if tok_spec is not None else None
    engine = build_engine(_served_engine_config(cfg.engine, args.disable_radix_cache), model,
                          tokenizer=tokenizer)  # fmt: skip
    app = create_app(engine, tokenizer, model_path=str(args.model), options=options,
                     weight_version=args.weight_version)  # fmt: skip
    auth = f"API key on {options.api_key_scope} endpoints" if options.api_key else "no API key"
    print(
        f"slipstream serve: {options.served_model_name} on http://{args.host}:{args.port} "
        f"({engine.num_slots} slots x {engine.max_seq_len} tokens, {auth})",
        flush=True,
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
    return 0
