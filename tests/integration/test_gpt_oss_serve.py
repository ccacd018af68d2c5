"""`slipstream serve` on a transformers-saved GPT-OSS directory (every feature on, sinks and
biases random, sliding window 4): one batched /generate of mixed-length prompts (5 to 40 tokens,
up to 10 windows) answers transformers' greedy `generate`, token for token, and the second round
is served from the prefix cache (`meta_info.cached_tokens`)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import torch

from jobutil import start_server, wait_healthy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_families import _hf_model  # noqa: E402

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # a server process: ~25 s on an idle 2-core host


def test_serve_greedy_equals_transformers_generate_with_prefix_hits(tmp_path) -> None:
    hf = _hf_model("gpt_oss")
    model_dir = tmp_path / "gpt_oss"
    hf.save_pretrained(model_dir)
    g = torch.Generator().manual_seed(4)
    base = torch.randint(3, hf.config.vocab_size, (40,), generator=g).tolist()
    prompts = [base[:33], base, base[:20] + [7, 8, 9], base[:5], base[:36]]
    news = [5, 4, 6, 8, 3]
    want = []
    with torch.no_grad():
        for p, n in zip(prompts, news, strict=True):
            out = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)
            want.append(out[0, len(p) :].tolist())
    proc, url = start_server(tmp_path, model_dir)
    try:
        wait_healthy(proc, url, tmp_path / "server.log")
        body = {"input_ids": prompts,
                "sampling_params": [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
                                    for n in news]}  # fmt: skip
        cached = []
        for _ in range(2):
            r = httpx.post(f"{url}/generate", json=body, timeout=120)
            r.raise_for_status()
            assert [o["output_ids"] for o in r.json()] == want
            cached.append(sum(o["meta_info"]["cached_tokens"] for o in r.json()))
        assert cached[1] >= 4 * 16  # whole 16-token blocks of the shared prefixes
    finally:
        proc.terminate()
        proc.wait(30)
