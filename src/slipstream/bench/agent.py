"""`slipstream bench agent`: the episode endpoint's overhead per model call.

The same --calls chat calls (the task's prompts as one user message, --tokens sampled tokens
each, EOS ignored so every call samples the same count) two ways, in one run, on one native
engine with the config's [model] (random weights):
- baseline: `engine.generate` on the prompt ids, one call after another (what the episode loop
  does for a built-in environment's turn);
- figure: POST /chat/completions to an episode's endpoint (envs/agent_endpoint.py) from an HTTP
  client in this process (httpx, keep-alive), one call after another: the chat template, request
  parsing, the session's checks and recording, JSON out and the HTTP round trip on top of the
  same generation;
- also: the same through the `openai` SDK client (what an agent pays, minus its process start).
The three ways run interleaved, call by call, in a rotating order (a shared host's load falls
on all alike); mean and p50 latency per call, and the overhead per call as the median of the
paired differences (endpoint - direct, same prompt, back to back), in ms. JSON with
provenance in benchmarks/results/agent.json (or --out). Not covered: concurrent episodes, an
agent process's start (the `openai` import: ~1 s of CPU), streaming.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from slipstream.config.args import add_config_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="episode endpoint's overhead per call vs a direct engine call",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_config_args(p)
    p.add_argument("--calls", type=int, default=100, help="calls per way")
    p.add_argument("--tokens", type=int, default=16, help="sampled tokens per call")
    p.add_argument("--out", default="benchmarks/results/agent.json", help="JSON output path")
    p.set_defaults(func=run)


def _stats(seconds: list[float]) -> dict[str, float]:
    return {"mean_ms": 1e3 * statistics.fmean(seconds),
            "p50_ms": 1e3 * statistics.median(seconds)}  # fmt: skip


def _paired(a: list[float], b: list[float]) -> float:
    """Median of the per-call differences a - b, in ms (same prompt, back to back)."""
    return 1e3 * statistics.median(x - y for x, y in zip(a, b, strict=True))


def run(args: argparse.Namespace) -> int:
    import httpx
    import torch
    from openai import OpenAI

    from slipstream.config import load_config
    from slipstream.engine import build_engine
    from slipstream.engine.base import GenerateRequest, SamplingParams
    from slipstream.envs.agent_endpoint import AgentEndpoint
    from slipstream.model import MoEForCausalLM
    from slipstream.observe.provenance import collect_provenance, write_result
    from slipstream.tasks import get_taskset

    cfg = load_config(args.config, args.overrides)
    ts = get_taskset(cfg.task)
    tok = ts.tokenizer
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg.model.model_copy(update={"vocab_size": tok.vocab_size})).eval()
    engine = build_engine(cfg.engine, model, tokenizer=tok)
    tasks = ts.train_batch(0, args.calls)
    messages = [[{"role": "user", "content": t.prompt}] for t in tasks]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.tokens, ignore_eos=True)
    endpoint = AgentEndpoint(engine, tok, max_turn_tokens=args.tokens,
                             context_tokens=engine.max_seq_len)  # fmt: skip
    try:
        session = endpoint.open(max_calls=3 * args.calls + 2, max_sampled_tokens=1 << 30)
        body: dict[str, Any] = {"model": "policy", "max_tokens": args.tokens, "ignore_eos": True}
        url = f"{session.base_url}/chat/completions"
        auth = {"Authorization": f"Bearer {session.api_key}"}
        client = OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        with httpx.Client(timeout=60) as http:

            def way_direct(m: list[dict[str, str]]) -> None:
                (c,) = engine.generate([GenerateRequest(tok.chat_prompt(m), params)])
                assert len(c.token_ids) == args.tokens

            def way_httpx(m: list[dict[str, str]]) -> None:
                r = http.post(url, headers=auth, json={**body, "messages": m})
                assert r.status_code == 200, r.text

            def way_sdk(m: list[dict[str, str]]) -> None:
                client.chat.completions.create(model="policy", messages=m,  # type: ignore[arg-type]
                                               max_tokens=args.tokens,
                                               extra_body={"ignore_eos": True})  # fmt: skip

            ways = [way_direct, way_httpx, way_sdk]
            times: list[list[float]] = [[], [], []]
            for w in ways:  # warm-up: first forward, connection, the SDK's first request
                w(messages[0])
            # interleaved, the order rotating per call, so a shared host's load hits every way
            # alike; medians and paired differences are what the run reports
            for i, m in enumerate(messages):
                for k in range(3):
                    j = (i + k) % 3
                    t0 = time.perf_counter()
                    ways[j](m)
                    times[j].append(time.perf_counter() - t0)
        direct, served, sdk = times
        recorded = len(session.calls)
        session.close()
    finally:
        endpoint.close()
        engine.close()
    d, s, o = _stats(direct), _stats(served), _stats(sdk)
    record = {
        "benchmark": "agent",
        "figure": {"name": "episode endpoint (httpx, keep-alive), per call", **s},
        "baseline": {"name": "engine.generate, per call", **d},
        "openai_sdk": {"name": "episode endpoint through the openai SDK, per call", **o},
        "overhead_ms": {"httpx_median_paired": _paired(served, direct),
                        "openai_sdk_median_paired": _paired(sdk, direct)},
        "calls": args.calls, "tokens_per_call": args.tokens, "recorded_calls": recorded,
        "params": sum(p.numel() for p in model.parameters()),
        "provenance": collect_provenance({"loadavg_1_5_15": os.getloadavg()}),
    }  # fmt: skip
    path = write_result(args.out, record)
    print(f"per call, {args.calls} calls of {args.tokens} tokens (mean / p50 ms):")
    print(f"  direct engine.generate    {d['mean_ms']:8.2f} / {d['p50_ms']:8.2f}   (baseline)")
    print(f"  endpoint, httpx           {s['mean_ms']:8.2f} / {s['p50_ms']:8.2f}   "
          f"overhead (median of paired differences) {_paired(served, direct):+.2f} ms")  # fmt: skip
    print(f"  endpoint, openai SDK      {o['mean_ms']:8.2f} / {o['p50_ms']:8.2f}   "
          f"overhead (median of paired differences) {_paired(sdk, direct):+.2f} ms")  # fmt: skip
    print(f"wrote {path}")
    return 0
