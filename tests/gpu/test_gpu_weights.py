"""A weight version pushed to an engine on the trainer's own GPU (engine.weight_sync =
"colocated", issue 31): CUDA IPC handles through SGLang's POST /update_weights_from_tensor
(`IpcSender`) into a `slipstream serve` process on the same device; the engine then serves
exactly the pushed values, and publish -> served is recorded next to a device-to-device copy of
the same bytes (the issue's limit; at this tiny shape the HTTP round trip dominates, so the
figure is for the record, not the goal, which needs `mid`).

On the CPU (SLIPSTREAM_GPU_TESTS_ON_CPU=1) the same test pushes over gloo with
`DistributedSender` instead: CUDA IPC has no CPU analogue, so that mode checks the server, the
push and the read-back, not the IPC path."""

from __future__ import annotations

import statistics
import time

import httpx
import pytest
import torch

from jobutil import TINY_MODEL, save_random_init, start_server, wait_healthy
from slipstream.config import load_config
from slipstream.engine.weight_transport import DistributedSender, IpcSender
from slipstream.model import MoEForCausalLM, hf_weights
from slipstream.tasks import get_taskset


@pytest.mark.gpu
def test_colocated_push_serves_the_pushed_weights(gpu, record, tmp_path) -> None:
    save_random_init(tmp_path / "init", TINY_MODEL)
    proc, url = start_server(tmp_path, tmp_path / "init", [f"engine.device={gpu.type}"])
    sender = None
    try:
        wait_healthy(proc, url, tmp_path / "server.log")
        cfg = load_config(None, TINY_MODEL)
        vocab = get_taskset(cfg.task).tokenizer.vocab_size
        sender = (IpcSender([url], timeout_s=120) if gpu.type == "cuda"
                  else DistributedSender([url], timeout_s=120))  # fmt: skip
        times = []
        for version in (1, 2, 3):
            torch.manual_seed(version)
            model = MoEForCausalLM(cfg.model.model_copy(update={"vocab_size": vocab})).to(gpu)
            state, _ = hf_weights(model)
            t0 = time.perf_counter()
            report = sender.send(version, state)
            times.append(time.perf_counter() - t0)
            assert sorted(report.served_s) == [url] and not report.dropped, report
            info = httpx.get(f"{url}/get_model_info", timeout=30).json()
            assert info["weight_version"] == str(version)
            for name in ("model.norm.weight", "model.layers.0.mlp.experts.3.down_proj.weight"):
                got = httpx.post(f"{url}/get_weights_by_name", timeout=30,
                                 json={"name": name, "truncate_size": 64}).json()  # fmt: skip
                assert got == state[name].reshape(-1)[:64].float().cpu().tolist(), name
        flat = torch.cat([t.detach().reshape(-1) for t in state.values()])
        dst = torch.empty_like(flat)
        copies = []
        for _ in range(5):
            if gpu.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(flat)
            if gpu.type == "cuda":
                torch.cuda.synchronize()
            copies.append(time.perf_counter() - t0)
        record(transport="cuda_ipc" if gpu.type == "cuda" else "gloo",
               bytes=flat.numel() * flat.element_size(),
               publish_to_served_s=statistics.median(times[1:]),
               device_copy_s=statistics.median(copies))  # fmt: skip
    finally:
        if sender is not None:
            sender.close()
        proc.terminate()
        proc.wait(timeout=30)
