"""Weights over the wire, real processes over gloo: `slipstream serve` processes receive weight
versions through SGLang's distributed-update endpoints and vLLM's weight-transfer API
(engine/weight_transport.py, engine/weight_routes.py).

- A client written only against SGLang's documented protocol (httpx + torch.distributed; no
  slipstream code on the sending side) pushes new weights, one broadcast per tensor as SGLang's
  default; greedy output afterwards equals transformers' on the pushed weights.
- `DistributedSender` pushes to two engines; one is stopped and then killed (-9) mid-transfer:
  the push returns within its bounded timeout, the dead engine is dropped, the survivor serves
  the version over a new group; a third engine joining mid-run catches up from the store and
  receives the next version; every group name is opened once (none lost, none reused).
- An RL job whose workers generate on an external server (`engine.type = "http"`, a `slipstream
  serve` process standing in) pushes every version to it (`engine.weight_sync = "distributed"`)."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from jobutil import TINY_MODEL, save_random_init, start_server, wait_healthy
from sglang_pg import init_custom_process_group
from slipstream.config import load_config
from slipstream.engine.weight_transport import (
    DistributedSender,
    WeightGroup,
    free_port,
    store_catch_up,
)
from slipstream.model import MoEForCausalLM, hf_weights, save_pretrained
from slipstream.storage import WeightStore
from slipstream.tasks import get_taskset


class Servers:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        save_random_init(tmp / "init", TINY_MODEL)

    def start(self, i: int, extra: tuple[str, ...] = ()) -> str:
        d = self.tmp / f"server{i}"
        d.mkdir()
        proc, url = start_server(d, self.tmp / "init", extra)
        self.procs.append(proc)
        wait_healthy(proc, url, d / "server.log")
        return url

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:  # never leave a server behind a failed test
                    p.kill()
                    p.wait(timeout=30)
                    raise


@pytest.fixture
def servers(tmp_path):
    s = Servers(tmp_path)
    yield s
    s.close()


def _new_model(seed: int) -> MoEForCausalLM:
    cfg = load_config(None, TINY_MODEL)
    vocab = get_taskset(cfg.task).tokenizer.vocab_size
    torch.manual_seed(seed)
    return MoEForCausalLM(cfg.model.model_copy(update={"vocab_size": vocab})).eval()


def _model_info(url: str) -> dict:
    return httpx.get(f"{url}/get_model_info", timeout=10).json()


@pytest.fixture(autouse=True)
def groups_released():
    """The trainer's end of these tests lives in this pytest process: the groups a test formed
    are destroyed after it, as its trainer process's exit would do. torch keeps one group per
    name per process, so a client test's group left behind made a later test's sender refused
    ('already created') under the same name."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    before = set(_world.pg_names)
    yield
    for pg in set(_world.pg_names) - before:
        try:
            dist.destroy_process_group(pg)
        except (RuntimeError, ValueError, KeyError, AssertionError):
            pass  # a sender's own teardown thread got there first


def _rank0(port: int, group: str, init: Callable[[], None]) -> tuple[Any, datetime.timedelta]:
    """The trainer's end of a 2-rank gloo group, formed while `init` (the engine's init
    request) runs on a thread, with SGLang's own `init_custom_process_group` (sglang_pg.py):
    what OpenRLHF, SkyRL, open-instruct and PipelineRL run on their side."""
    t = threading.Thread(target=init)
    t.start()
    timeout = datetime.timedelta(seconds=60)
    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                                   timeout=timeout, world_size=2, rank=0, group_name=group)  # fmt: skip
    t.join()
    return pg, timeout


def test_sglang_protocol_client_pushes_over_gloo_and_greedy_equals_transformers(servers, tmp_path):
    import torch.distributed as dist

    pytest.importorskip("transformers")
    url = servers.start(0)
    model = _new_model(seed=1)
    state, _ = hf_weights(model)
    names = list(state)
    port, group = free_port(), "weight_update_group"

    # --- the SGLang client: only the documented endpoints and torch.distributed ---
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "group_name": group, "backend": "gloo"}  # fmt: skip
    answers: dict[str, httpx.Response] = {}
    pg, timeout = _rank0(port, group, lambda: answers.update(
        init=httpx.post(f"{url}/init_weights_update_group", json=init, timeout=60)))  # fmt: skip
    assert answers["init"].json()["success"], answers["init"].text
    body = {"names": names, "dtypes": [str(state[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(state[n].shape) for n in names], "group_name": group,
            "flush_cache": True, "weight_version": "7"}  # fmt: skip
    t = threading.Thread(target=lambda: answers.update(
        update=httpx.post(f"{url}/update_weights_from_distributed", json=body, timeout=60)))  # fmt: skip
    t.start()
    for n in names:  # SGLang's default format: one broadcast per tensor, in `names` order
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        pg.broadcast([state[n].contiguous()], opts).wait(timeout)
    t.join()
    assert answers["update"].status_code == 200 and answers["update"].json()["success"]
    assert _model_info(url)["weight_version"] == "7"
    got = httpx.post(f"{url}/get_weights_by_name",
                     json={"name": "model.embed_tokens.weight", "truncate_size": 10}, timeout=10)  # fmt: skip
    assert got.json() == state["model.embed_tokens.weight"].reshape(-1)[:10].tolist()

    # colocated (CUDA IPC) on a CPU engine: refused, naming why; the weights stay
    resp = httpx.post(f"{url}/update_weights_from_tensor",
                      json={"serialized_named_tensors": ["AA=="], "weight_version": "8"}, timeout=10)  # fmt: skip
    assert resp.status_code == 400 and "needs a CUDA engine" in resp.json()["message"]
    assert _model_info(url)["weight_version"] == "7"

    # --- greedy after the push == transformers on the pushed weights ---
    _greedy_equals_transformers(url, model, tmp_path / "pushed")


def _greedy_equals_transformers(url: str, model: MoEForCausalLM, path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    save_pretrained(model, path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for prompt in ([1, 5, 7, 9], [1, 12, 3]):
        out = httpx.post(f"{url}/generate", json={"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}, timeout=60).json()  # fmt: skip
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(6):
                nxt = hf(ids).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], dim=1)
        assert out["output_ids"] == ids[0, len(prompt) :].tolist()


def test_vllm_protocol_client_pushes_over_gloo_and_greedy_equals_transformers(servers, tmp_path):
    """A client written only against vLLM's weight-transfer API (its dev-mode RLHF routes, as
    vLLM's HTTPVLLMWeightSyncClient and TRL call them; the one extension: `backend` "gloo" in
    init_info, since vLLM's own group is NCCL) pushes into `slipstream serve`; the version is
    served only once /finish_weight_update names it, an update missing parameters is refused at
    the finish with the served weights unchanged, and greedy then equals transformers'."""
    import torch.distributed as dist

    pytest.importorskip("transformers")
    url = servers.start(0)
    assert httpx.get(f"{url}/get_world_size", timeout=10).json() == {"world_size": 1}
    model = _new_model(seed=4)
    state, _ = hf_weights(model)
    names = list(state)
    port = free_port()
    init = {"init_info": {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                          "world_size": 2, "backend": "gloo"}}  # fmt: skip
    answers: dict[str, httpx.Response] = {}
    # the engine's end of vLLM's protocol is the group "vllm-weight-transfer" (vLLM names none)
    pg, timeout = _rank0(port, "vllm-weight-transfer", lambda: answers.update(
        init=httpx.post(f"{url}/init_weight_transfer_engine", json=init, timeout=60)))  # fmt: skip
    assert answers["init"].status_code == 200, answers["init"].text
    assert answers["init"].json() == {"message": "Weight transfer initialized"}

    def update(batch: list[str]) -> httpx.Response:
        info = {"names": batch, "dtype_names": [str(state[n].dtype).removeprefix("torch.")
                                                for n in batch],
                "shapes": [list(state[n].shape) for n in batch], "packed": False}  # fmt: skip
        out: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: out.update(r=httpx.post(
            f"{url}/update_weights", json={"update_info": info}, timeout=60)))  # fmt: skip
        t.start()
        for n in batch:  # one broadcast per tensor, in `names` order (packed=False)
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            pg.broadcast([state[n].contiguous()], opts).wait(timeout)
        t.join()
        return out["r"]

    # an update that misses a parameter is refused at the finish; nothing changes
    assert httpx.post(f"{url}/start_weight_update", timeout=10).status_code == 200
    assert update(names[:3]).status_code == 200
    resp = httpx.post(f"{url}/finish_weight_update", json={"weight_version": "5"}, timeout=10)
    assert resp.status_code == 400 and "not all" in resp.text
    assert _model_info(url)["weight_version"] == "0"
    # no update in progress now: /update_weights is refused before anything is received
    info = {"names": names[:1], "dtype_names": ["float32"], "shapes": [list(state[names[0]].shape)]}
    resp = httpx.post(f"{url}/update_weights", json={"update_info": info}, timeout=10)
    assert resp.status_code == 400 and "start_weight_update" in resp.text

    # the whole version in two requests: served at the finish, not before
    assert httpx.post(f"{url}/start_weight_update", timeout=10).status_code == 200
    half = len(names) // 2
    assert update(names[:half]).json() == {"message": "Weights updated"}
    assert _model_info(url)["weight_version"] == "0"
    assert update(names[half:]).status_code == 200
    assert _model_info(url)["weight_version"] == "0"
    resp = httpx.post(f"{url}/finish_weight_update", json={"weight_version": "5"}, timeout=10)
    assert resp.json() == {"message": "Weight update finished"}
    assert httpx.get(f"{url}/weight_info", timeout=10).json() == {"weight_version": "5"}
    got = httpx.post(f"{url}/get_weights_by_name",
                     json={"name": "model.norm.weight", "truncate_size": 8}, timeout=10)  # fmt: skip
    assert got.json() == state["model.norm.weight"].reshape(-1)[:8].tolist()
    # packed transfers (vLLM's packed_broadcast) are refused, naming what to send
    info = {**info, "packed": True}
    resp = httpx.post(f"{url}/update_weights", json={"update_info": info}, timeout=10)
    assert resp.status_code == 400 and "packed" in resp.text

    _greedy_equals_transformers(url, model, tmp_path / "pushed")


def test_distributed_sender_drives_vllm_protocol_to_two_engines(servers, tmp_path) -> None:
    """`DistributedSender(api="vllm")` (engine.api = "vllm"): rank offsets from /get_world_size,
    every version start -> per-bucket updates -> finish, on both engines; a killed engine is
    dropped and the survivor serves the version over a new group (the bounded wait on a stalled
    one is the same code, tested with SGLang's protocol above)."""
    a, b = servers.start(0), servers.start(1)
    sender = DistributedSender([a, b], bucket_bytes=2**16, timeout_s=20.0, api="vllm")
    try:
        for v in (1, 2):
            state, _ = hf_weights(_new_model(seed=10 + v))
            report = sender.send(v, state)
            assert sorted(report.served_s) == sorted([a, b]) and not report.dropped
            want = state["model.norm.weight"].reshape(-1)[:8].tolist()
            for u in (a, b):
                assert _model_info(u)["weight_version"] == str(v)
                got = httpx.post(f"{u}/get_weights_by_name",
                                 json={"name": "model.norm.weight", "truncate_size": 8}, timeout=10)  # fmt: skip
                assert got.json() == want
        os.kill(servers.procs[1].pid, signal.SIGKILL)
        servers.procs[1].wait(timeout=30)
        state, _ = hf_weights(_new_model(seed=13))
        report = sender.send(3, state)
        assert report.dropped == [b] and list(report.served_s) == [a], report
        assert _model_info(a)["weight_version"] == "3"
        assert sender.groups_opened == ["slipstream-weights-e1", "slipstream-weights-e2"]
    finally:
        sender.close()


def test_distributed_sender_survives_kill_mid_transfer_and_admits_a_joining_engine(
    servers, tmp_path
) -> None:
    a, b = servers.start(0), servers.start(1)
    store = WeightStore(str(tmp_path / "store"))
    caught_up: dict[str, str] = {}

    def catch_up(url: str, headers: dict[str, str]) -> None:
        """The store's catch-up, then what the engine serves: the newest stored version,
        before any push reached it (a no-op catch-up leaves it at 0)."""
        store_catch_up(store)(url, headers)
        caught_up[url] = _model_info(url)["weight_version"]

    sender = DistributedSender([a, b], bucket_bytes=2**16, timeout_s=20.0, catch_up=catch_up)
    try:
        v1, _ = hf_weights(_new_model(seed=1))
        report = sender.send(1, v1)
        assert sorted(report.served_s) == sorted([a, b]) and not report.dropped
        assert [_model_info(u)["weight_version"] for u in (a, b)] == ["1", "1"]

        # b is stopped, then killed -9, while version 2 is on the wire: after the first
        # broadcasts of it reached both engines (bytes in flight), mid-version
        proc_b = servers.procs[1]
        v2, config = hf_weights(_new_model(seed=2))
        done: dict = {}
        sent: list[int] = []
        real_broadcast = WeightGroup.broadcast

        def broadcast(self: WeightGroup, tensor: torch.Tensor) -> None:
            real_broadcast(self, tensor)
            sent.append(tensor.numel() * tensor.element_size())
            if len(sent) == 3:  # three tensors of version 2 arrived at both engines
                os.kill(proc_b.pid, signal.SIGSTOP)
                os.kill(proc_b.pid, signal.SIGKILL)

        WeightGroup.broadcast = broadcast  # type: ignore[method-assign]
        t = threading.Thread(target=lambda: done.update(report=sender.send(2, v2)))
        t0 = time.monotonic()
        try:
            t.start()
            t.join(timeout=120)
        finally:
            WeightGroup.broadcast = real_broadcast  # type: ignore[method-assign]
        assert len(sent) > 3 and sum(sent[:3]) > 0  # killed with bytes in flight, not before
        assert not t.is_alive(), "the push blocked past its bound"
        assert time.monotonic() - t0 < 120
        report = done["report"]
        assert report.dropped == [b] and report.retried, report
        assert list(report.served_s) == [a], report
        assert _model_info(a)["weight_version"] == "2"
        store.publish(2, v2, config)  # the store's copy (every N-th version)

        # c joins mid-run: loads the store's newest version, then gets version 3 pushed
        c = servers.start(2)
        sender.add_engine(c)
        v3, _ = hf_weights(_new_model(seed=3))
        report = sender.send(3, v3)
        assert caught_up == {c: "2"}  # from the store, before the push of 3 reached it
        assert sorted(report.served_s) == sorted([a, c])
        assert [_model_info(u)["weight_version"] for u in (a, c)] == ["3", "3"]
        want = v3["model.norm.weight"].reshape(-1)[:8].tolist()
        for u in (a, c):
            got = httpx.post(f"{u}/get_weights_by_name",
                             json={"name": "model.norm.weight", "truncate_size": 8}, timeout=10)  # fmt: skip
            assert got.json() == want
        assert sender.groups_opened == [f"slipstream-weights-e{i}" for i in (1, 2, 3)]
        assert sender.dropped == [b]
    finally:
        sender.close()


def _broadcast_while(request: Callable[[], httpx.Response], pg: Any,
                     tensors: list[torch.Tensor]) -> httpx.Response:  # fmt: skip
    """`request` on a thread while rank 0 broadcasts `tensors` (errors of a broken group are
    the test's to judge by the answer)."""
    import torch.distributed as dist

    out: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: out.update(r=request()))
    t.start()
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    try:
        for x in tensors:
            pg.broadcast([x], opts).wait(datetime.timedelta(seconds=30))
    except RuntimeError:
        pass  # the receiver is gone: its answer says why
    t.join(timeout=120)
    return out["r"]


def _generates(url: str) -> bool:
    out = httpx.post(f"{url}/generate", json={"input_ids": [1, 5, 7], "sampling_params": {
        "max_new_tokens": 2, "temperature": 0}}, timeout=60)  # fmt: skip
    return out.status_code == 200 and len(out.json()["output_ids"]) == 2


def test_a_broadcast_larger_or_shorter_than_declared_never_takes_the_server_down(servers) -> None:
    """Issue 44: a group member that broadcasts more bytes than /update_weights_from_distributed
    declared (float64 for a declared float32) made gloo abort the whole server
    (std::terminate on its transport thread); one that broadcast fewer had the rest of the
    tensor served from uninitialised staging. Now the larger one kills only the group's
    receiving process (503, the group gone), the shorter one is refused (400); the server keeps
    serving its weights, and a SGLang label ("disk_update_v2.0.0") names a version that
    arrives whole."""
    url = servers.start(0)
    norm = [32]  # model.norm.weight of TINY_MODEL (hidden 32), float32

    def group(name: str) -> Any:
        port = free_port()
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 2, "group_name": name, "backend": "gloo"}  # fmt: skip
        answers: dict[str, httpx.Response] = {}
        pg, _ = _rank0(port, name, lambda: answers.update(
            r=httpx.post(f"{url}/init_weights_update_group", json=init, timeout=120)))  # fmt: skip
        assert answers["r"].json()["success"], answers["r"].text
        return pg

    def update(name: str, version: str) -> Callable[[], httpx.Response]:
        body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [norm],
                "group_name": name, "weight_version": version}  # fmt: skip
        return lambda: httpx.post(f"{url}/update_weights_from_distributed", json=body,
                                  timeout=120)  # fmt: skip

    pg = group("g1")
    resp = _broadcast_while(update("g1", "3"), pg, [torch.ones(norm, dtype=torch.float64)])
    assert resp.status_code == 503 and "died" in resp.json()["message"], resp.text
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200 and _generates(url)
    assert _model_info(url)["weight_version"] == "0"

    pg = group("g2")  # the broken group was dropped: a new one forms
    resp = _broadcast_while(update("g2", "3"), pg, [torch.ones([16], dtype=torch.float32)])
    assert resp.status_code == 400 and "fewer bytes arrived" in resp.json()["message"], resp.text
    assert _model_info(url)["weight_version"] == "0" and _generates(url)

    # the group survives a refusal: a whole version under a free-form label is served
    model = _new_model(seed=5)
    state, _ = hf_weights(model)
    names = list(state)
    body = {"names": names, "dtypes": ["float32"] * len(names),
            "shapes": [list(state[n].shape) for n in names], "group_name": "g2",
            "weight_version": "disk_update_v2.0.0"}  # fmt: skip
    resp = _broadcast_while(lambda: httpx.post(f"{url}/update_weights_from_distributed",
                                               json=body, timeout=120),
                            pg, [state[n].contiguous() for n in names])  # fmt: skip
    assert resp.status_code == 200 and resp.json()["success"], resp.text
    assert _model_info(url)["weight_version"] == "disk_update_v2.0.0"
    assert httpx.get(f"{url}/weight_info", timeout=10).json() == {
        "weight_version": "disk_update_v2.0.0"}  # fmt: skip


def test_a_silent_rendezvous_is_bounded_and_groups_are_capped(servers) -> None:
    """Issue 44: /init_weights_update_group at a listener that accepts and never answers had
    not returned after 200 s with weight_sync_timeout_s = 10, and nine of them starved every
    route on the server's default thread pool while /health said 200. Now each is answered
    503 at its deadline (its receiving process killed), at most MAX_WEIGHT_GROUPS join at
    once (the next is refused at once), and the other routes answer meanwhile."""
    import socket

    from slipstream.engine.weight_transport import MAX_WEIGHT_GROUPS

    url = servers.start(0, ("engine.weight_sync_timeout_s=3",))
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    accepted: list = []
    threading.Thread(target=lambda: [accepted.append(silent.accept()) for _ in range(64)],
                     daemon=True).start()  # fmt: skip
    port = silent.getsockname()[1]
    answers: dict[int, httpx.Response] = {}

    def init(i: int) -> None:
        body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 2, "group_name": f"silent{i}", "backend": "gloo"}  # fmt: skip
        answers[i] = httpx.post(f"{url}/init_weights_update_group", json=body, timeout=120)

    threads = [threading.Thread(target=init, args=(i,)) for i in range(MAX_WEIGHT_GROUPS + 1)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    # while they wait: the routes of the default pool answer
    assert _model_info(url)["weight_version"] == "0" and _generates(url)
    for t in threads:
        t.join(timeout=120)
    elapsed = time.monotonic() - t0
    codes = sorted(r.status_code for r in answers.values())
    assert codes == [400] + [503] * MAX_WEIGHT_GROUPS, [r.text for r in answers.values()]
    refused = next(r for r in answers.values() if r.status_code == 400)
    assert f"at most {MAX_WEIGHT_GROUPS}" in refused.json()["message"]
    late = next(r for r in answers.values() if r.status_code == 503)
    assert "within 3 s" in late.json()["message"], late.text
    assert elapsed < 60, elapsed  # 3 s each, concurrently (+ starting the receiving processes)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    silent.close()


def test_distributed_sender_forms_groups_as_sglangs_engine_does(tmp_path) -> None:
    """Our trainer's end against SGLang's engine end: a stand-in that serves SGLang's
    /init_weights_update_group and /update_weights_from_distributed exactly as SGLang's
    engine does (tests/sglang_standin.py: SGLang's init_custom_process_group, one
    torch.distributed.broadcast per tensor into an empty tensor of the declared dtype and
    shape) receives two versions from `DistributedSender` bit for bit."""
    import json
    import subprocess
    import sys

    out = tmp_path / "received.json"
    port = free_port()
    here = Path(__file__).parent.parent
    proc = subprocess.Popen([sys.executable, str(here / "sglang_standin.py"), str(port), str(out)],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "standin.log", "wb"))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    sender = DistributedSender([url], bucket_bytes=2**12, timeout_s=60.0)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "standin.log").read_text()[-2000:]  # fmt: skip
            time.sleep(0.1)
        for v in (1, 2):
            state, _ = hf_weights(_new_model(seed=20 + v))
            report = sender.send(v, state)
            assert list(report.served_s) == [url] and not report.dropped, report
            got = json.loads(out.read_text())
            assert got["weight_version"] == str(v) and sorted(got["sums"]) == sorted(state)
            for name, t in state.items():
                assert got["sums"][name] == float(t.double().sum()), name
        assert sender.groups_opened == ["slipstream-weights-e1"]
    finally:
        sender.close()
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_weights_runs_store_distributed_and_raw_in_one_run(tmp_path, dtype) -> None:
    """The bench end to end, also in bfloat16 (how `mid` fits two engines in this host's memory:
    the model, the engines and the raw broadcast in that dtype)."""
    import json

    from slipstream.cli import main

    out = tmp_path / "weights.json"
    assert main(["bench", "weights", "--engines", "1", "--repeats", "1", "--out", str(out),
                 f"--run.dtype={dtype}"]) == 0  # fmt: skip
    record = json.loads(out.read_text())
    (row,) = record["rows"]
    assert record["dtype"] == dtype  # and the engines served what was pushed in it (else it raises)
    assert row["engines"] == 1 and row["bytes"] > 0
    assert row["store_s"] > 0 and row["distributed_s"] > 0 and row["raw_broadcast_s"] > 0
    assert record["provenance"]["cpu_model"] and len(record["load_avg_before"]) == 3


def test_rl_job_with_two_workers_and_distributed_weight_sync(tmp_path) -> None:
    """The RL job (controller here, 2 rollout worker processes whose native engines take pushes
    over gloo; staleness bound 1 and R3 routing replay on): it trains to the end; tokens were sampled with versions that only the pushes
    carried (the store holds every 4th); one worker killed -9 mid-run is replaced and its
    successor joins the pushes; per-worker publish -> served seconds are recorded."""
    from slipstream.launch.local import LocalLauncher
    from slipstream.rl.controller import Controller

    cfg = load_config(None, [
        f"run.output_dir={tmp_path}/run", *TINY_MODEL, "engine.weight_sync=distributed",
        "engine.weight_store_every=4", "engine.weight_sync_timeout_s=10", "trainer.mode=async",
        "buffer.max_staleness=1", "trainer.steps=30", "trainer.groups_per_step=2",
        "rollout.group_size=2", "rollout.num_workers=2", "rollout.tasks_per_lease=2",
        "rollout.max_inflight_tasks=2", "rollout.lease_ttl_s=2", "rollout.partial_rollouts=true",
        "trainer.checkpoint_every=0", "trainer.lr=0.01", f"store.url={tmp_path}/store",
        "rollout.record_routing=true", "trainer.routing_replay=r3",  # R3 over pushed weights
    ])  # fmt: skip
    save_random_init(tmp_path / "init", TINY_MODEL)
    controller = Controller(cfg, str(tmp_path / "init"), evaluate=False)
    versions: list[tuple[int, list[int]]] = []
    real_step = controller.trainer.step

    killed = threading.Event()

    def successor() -> bool:
        return any(w.startswith("w1.") and w != "w1.0" for w in controller.coord.engines())

    def hold(until, what: str) -> None:
        deadline = time.monotonic() + 180
        while not until():
            assert time.monotonic() < deadline, (what, controller.trainer.version,
                                                 sorted(controller.coord.engines()),
                                                 controller.coord.weight_served)  # fmt: skip
            time.sleep(0.05)

    def up(*urls: str) -> bool:  # answering /health (their groups' receiving side ready)
        try:
            return all(httpx.get(f"{u}/health", timeout=5).status_code == 200 for u in urls)
        except httpx.HTTPError:
            return False

    def healthy() -> bool:  # both first engines registered and up
        engines = controller.coord.engines()
        return len(engines) >= 2 and up(*(url for url, _ in engines.values()))

    def successor_url() -> list[str]:
        return [u for w, (u, _) in controller.coord.engines().items()
                if w.startswith("w1.") and w != "w1.0"]  # fmt: skip

    def step(batch):
        # Wait on conditions, not on luck: at version 3 the trainer waits until both workers'
        # engines are up (each starts its weight groups' forkserver first; on a loaded host the
        # whole job once ended before they were, every version reaching them by the store), and
        # from version 8 until the kill below happened (the pushes of 4-7 reached both).
        if not killed.is_set() and controller.trainer.version >= 3:
            hold(lambda: killed.is_set() or healthy(), "the engines never both became healthy")
        if not killed.is_set() and controller.trainer.version >= 8:
            hold(killed.is_set, "both engines never served a push")
        if killed.is_set():  # hold the trainer until w1's successor's engine is up
            hold(lambda: successor() and up(*successor_url()), "w1's successor never came up")
        for s in batch.samples:
            assert batch.trainer_version - min(s.versions) <= 1, (batch.trainer_version, s.versions)
            versions.append((batch.trainer_version, s.versions))
            assert s.routed_experts is not None  # R3: the engine's routing came with the sample
        return real_step(batch)

    controller.trainer.step = step  # type: ignore[method-assign]
    launcher = LocalLauncher(cfg, controller.coord)
    launcher.start()
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(r=controller.run()))
    runner.start()
    try:
        while runner.is_alive():
            runner.join(timeout=0.1)
            ready = len(controller.coord.weight_served) == 2 and controller.trainer.version >= 3
            if ready and not killed.is_set():
                # a worker's engine endpoint answers only the trainer (its key came over the
                # coordinator's channel): other local users cannot replace its weights
                url, key = controller.coord.engines()["w0.0"]
                body = {"group_name": "x"}
                denied = httpx.post(f"{url}/destroy_weights_update_group", json=body, timeout=10)
                assert denied.status_code == 401
                ok = httpx.post(f"{url}/destroy_weights_update_group", json=body, timeout=10,
                                headers={"Authorization": f"Bearer {key}"})  # fmt: skip
                assert ok.status_code == 400  # authorized; no such group
                os.kill(launcher.procs[1].pid, signal.SIGKILL)  # the supervisor restarts w1
                killed.set()
    finally:
        launcher.stop()
    assert "r" in result and result["r"].steps == 30
    assert killed.is_set()
    tokens = {v for _, vs in versions for v in vs}
    stored = set(WeightStore(cfg.store.url).versions())
    assert tokens - set(range(0, 30, 4)), "no token was sampled with a pushed-only version"
    # every 4th, the last on flush, and at most the one version the kill made w1 miss
    assert 30 in stored and len(stored - {*range(0, 30, 4), 30}) <= 1
    served = controller.coord.weight_served
    assert (
        "w0.0" in served
        and successor()
        and any(
            w in served for w in controller.coord.engines() if w.startswith("w1.") and w != "w1.0"
        )
    )
    assert all(s["seconds"] > 0 for s in served.values())
    records = [r for r in result["r"].records if "weight_served_s_max" in r]
    assert records and all(r["weight_served_s_max"] > 0 for r in records)


def test_rl_job_pushes_every_version_to_an_external_server(servers, tmp_path) -> None:
    """engine.type = http with weight_sync = distributed: the job's two rollout workers
    generate on one `slipstream serve` process standing in for an external SGLang server (both
    register its URL; it is pushed to once per version, under the checkpoint's per-expert
    names). Every token was sampled with a version the server served (it tags them itself),
    some with versions only a push carried (the store holds every 4th), and at the end the
    server serves the trainer's last version, bit for bit."""
    from slipstream.launch.local import LocalLauncher
    from slipstream.rl.controller import Controller

    (tmp_path / "server").mkdir()
    # not waited for here: it starts while the trainer and the workers do (they wait for it)
    proc, url = start_server(tmp_path / "server", tmp_path / "init")
    servers.procs.append(proc)
    cfg = load_config(None, [
        f"run.output_dir={tmp_path}/run", *TINY_MODEL, "engine.type=http", f"engine.url={url}",
        "engine.server_wait_s=60", "engine.weight_sync=distributed", "engine.weight_store_every=4",
        "engine.weight_sync_timeout_s=10", "trainer.mode=async", "buffer.max_staleness=1",
        "trainer.steps=6", "trainer.groups_per_step=2", "rollout.group_size=2",
        "rollout.num_workers=2", "rollout.tasks_per_lease=1", "rollout.max_inflight_tasks=1",
        "trainer.checkpoint_every=0", "trainer.lr=0.01", "trainer.skip_no_signal=false",
        f"store.url={tmp_path}/store",
    ])  # fmt: skip
    controller = Controller(cfg, str(tmp_path / "init"), evaluate=False)
    sync = controller.publisher
    assert sync.fused_experts is False  # an external server is pushed the per-expert names
    pushed: list[int] = []
    real_submit, real_step = sync.submit, controller.trainer.step

    def submit(version, state, hf_config):
        real_submit(version, state, hf_config)
        # what the server serves once the push returned (no engine was dropped: see below)
        pushed.append(int(_model_info(url)["weight_version"]))

    versions: list[tuple[int, list[int]]] = []

    def step(batch):
        for s in batch.samples:
            versions.append((batch.trainer_version, s.versions))
        return real_step(batch)

    sync.submit = submit  # type: ignore[method-assign]
    controller.trainer.step = step  # type: ignore[method-assign]
    launcher = LocalLauncher(cfg, controller.coord)
    launcher.start()
    try:
        result = controller.run()
    finally:
        codes = launcher.stop()
    assert result.steps == 6 and codes == {0: 0, 1: 0} and launcher.num_restarts == 0
    # both workers registered the one server; the trainer pushed to it, never dropped it
    assert {u for u, _ in controller.coord.engines().values()} == {url}
    assert sync.sender.members == [url] and sync.sender.dropped == []
    assert {"w0.0", "w1.0"} <= set(controller.coord.weight_served)
    tokens = {v for _, vs in versions for v in vs}
    stored = set(WeightStore(cfg.store.url).versions())
    assert tokens <= set(pushed) | stored, (tokens, pushed, stored)  # versions the server served
    assert tokens - stored, f"no token was sampled with a pushed-only version: {tokens}"
    assert all(t - min(vs) <= 1 for t, vs in versions)  # the staleness bound held
    # the server serves the trainer's last version: the label and the tensors
    assert pushed[-1] == controller.trainer.version == 6
    assert _model_info(url)["weight_version"] == "6"
    state, _ = hf_weights(controller.model)
    name = next(n for n in state if ".experts.0." in n)
    served = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 64},
                        timeout=10).json()  # fmt: skip
    assert served == state[name].reshape(-1)[:64].float().tolist()
