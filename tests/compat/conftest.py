"""`slipstream serve` as a real subprocess on a tiny MoE checkpoint (HF format, char tokenizer
with its chat template), with serve's default prefix cache (on, as SGLang's radix cache) and
vLLM's `--enable-prompt-tokens-details`, shared by the compat suite; a second
checkpoint for the weight-update tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from compat_server import MAX_SEQ_LEN, Served, tiny

pytest.importorskip("fastapi")


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from slipstream.model import save_pretrained
    from slipstream.model.tokenizer import CharTokenizer

    root = tmp_path_factory.mktemp("compat")
    ckpt, other = root / "tiny-moe", root / "tiny-moe-2"
    tok = CharTokenizer()
    for seed, path in ((0, ckpt), (5, other)):
        save_pretrained(tiny(seed, tok.vocab_size), path)
        tok.save(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).parent / "slipstream"
    cmd = [str(exe), "serve", "--model", str(ckpt), "--port", str(port),
           f"--engine.max_seq_len={MAX_SEQ_LEN}", "--engine.kv_cache_tokens=2048",
           "--engine.max_batch_size=16", "--enable-prompt-tokens-details",
           "--weight-version", "test_version_1.0"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(root / "serve.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # wait for the condition: /health answers 200
            assert proc.poll() is None, (root / "serve.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "slipstream serve did not come up"
            time.sleep(0.1)
        yield Served(url, ckpt.name, ckpt, other, tok.vocab_size)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
