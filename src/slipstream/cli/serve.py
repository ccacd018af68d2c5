"""`slipstream serve --model DIR`: the native engine behind SGLang's native HTTP API (+ OpenAI
completions). The `[engine]` config section sizes the engine (KV budget, batch, slot length)."""

from __future__ import annotations

import argparse
import logging

from slipstream.cli import add_config_args
from slipstream.config import load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over HTTP (SGLang native API subset + /v1/completions)",
        description="Serve an HF-format model directory with slipstream's native engine. Endpoints: "
        "/generate, /update_weights_from_disk, /flush_cache, /abort_request, /get_model_info, "
        "/health, /health_generate, /v1/completions, /v1/models.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="HF-format model directory")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="SPEC",
        help="tokenizer: 'char', a directory or a tokenizer.json (default: the model directory "
        "if it holds one, else none: clients must send input_ids)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--log-level", default="warning")
    add_config_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    import uvicorn

    from slipstream.engine.native import NativeEngine
    from slipstream.engine.server import create_app
    from slipstream.model import load_pretrained
    from slipstream.model.tokenizer import TOKENIZER_FILE, load_tokenizer

    logging.basicConfig(level=args.log_level.upper())
    cfg = load_config(args.config, args.overrides)
    model = load_pretrained(args.model, device=cfg.engine.device)
    tok_spec = args.tokenizer
    if tok_spec is None and (Path(args.model) / TOKENIZER_FILE).is_file():
        tok_spec = args.model
    tokenizer = load_tokenizer(tok_spec) if tok_spec is not None else None
    engine = NativeEngine(model, cfg.engine, tokenizer=tokenizer)
    app = create_app(engine, tokenizer, model_path=str(args.model))
    print(
        f"slipstream serve: {args.model} on http://{args.host}:{args.port} "
        f"({engine.num_slots} slots x {engine.max_seq_len} tokens)",
        flush=True,
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
    return 0
