"""engine/weight_transport.py in one process: buckets, flattening, the config keys, and the
receiver's version exactness over a real gloo group (sender rank 0 and the engine's receiver
rank 1 on two threads)."""

from __future__ import annotations

import threading

import pytest
import torch
from pydantic import ValidationError
from test_engine_checks import tiny_model

from slipstream.config.engine import EngineConfig
from slipstream.engine.native import NativeEngine
from slipstream.engine.weight_transport import (
    FLATTENED_BUCKET,
    GROUP_PROCESSES_READY,
    DistributedSender,
    TensorMeta,
    WeightGroup,
    WeightReceiver,
    dtype_name,
    flatten,
    free_port,
    parse_dtype,
    plan_buckets,
    unflatten,
)
from slipstream.model import hf_weights


def test_buckets_are_dtype_grouped_and_bounded() -> None:
    metas = [TensorMeta("a", torch.float32, (4, 4)), TensorMeta("b", torch.bfloat16, (8,)),
             TensorMeta("c", torch.float32, (10,)), TensorMeta("big", torch.float32, (100,)),
             TensorMeta("d", torch.float32, (2,))]  # fmt: skip
    buckets = plan_buckets(metas, bucket_bytes=128)
    assert [[m.name for m in b] for b in buckets] == [["a", "c"], ["big"], ["d"], ["b"]]
    assert all(len({m.dtype for m in b}) == 1 for b in buckets)
    assert [[m.name for m in b] for b in plan_buckets(metas, 10**6)] == [
        ["a", "c", "big", "d"],
        ["b"],
    ]
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(metas, 0)


def test_flatten_round_trips_and_checks_the_count() -> None:
    ts = {"x": torch.randn(3, 4), "y": torch.randn(5)}
    metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in ts.items()]
    back = unflatten(flatten(list(ts.values())), metas)
    assert all(torch.equal(back[n], ts[n]) for n in ts)
    with pytest.raises(ValueError, match="holds 18 values"):
        unflatten(torch.zeros(18), metas)


def test_dtype_names_are_sglangs_and_only_floating() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16" and parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("torch.float32") is torch.float32
    with pytest.raises(ValueError, match="int64"):
        parse_dtype("int64")


def test_config_keys_are_bounded_and_colocated_needs_cuda() -> None:
    assert EngineConfig().weight_sync == "store"
    with pytest.raises(ValidationError, match="weight_bucket_bytes"):
        EngineConfig(weight_bucket_bytes=1024)
    with pytest.raises(ValidationError, match="weight_store_every"):
        EngineConfig(weight_store_every=0)
    with pytest.raises(ValidationError, match="engine.weight_sync = 'colocated'.*engine.device"):
        EngineConfig(weight_sync="colocated")
    # an external server (issue 44) takes pushes; IPC handles reach only the trainer's GPU
    http = {"type": "http", "url": "http://127.0.0.1:30000"}
    assert EngineConfig(**http, weight_sync="distributed").weight_sync == "distributed"
    with pytest.raises(ValidationError, match="'colocated' with engine.type = 'http'"):
        EngineConfig(**http, weight_sync="colocated", device="cuda")
    with pytest.raises(ValidationError, match="weight_sync_master_address"):
        EngineConfig(weight_sync_master_address="")


def test_vllm_api_is_for_distributed_per_tensor_pushes_and_reaches_the_sender(tmp_path) -> None:
    """engine.api = "vllm" selects vLLM's weight-transfer API for the job's pushes; it is
    refused where it would mean nothing (store) or what is not spoken (IPC, packed buckets)."""
    from slipstream.config import load_config
    from slipstream.rl.buffer import ExperienceBuffer
    from slipstream.rl.coordinator import Coordinator
    from slipstream.rl.queue import TaskQueue
    from slipstream.rl.weight_sync import make_weight_sync
    from slipstream.storage import WeightStore

    assert EngineConfig().api == "sglang"
    with pytest.raises(ValidationError, match="engine.api = 'vllm'.*weight_sync = 'distributed'"):
        EngineConfig(api="vllm")
    with pytest.raises(ValidationError, match="engine.api = 'vllm'.*'per_tensor'"):
        EngineConfig(api="vllm", weight_sync="distributed", weight_bucket_format="flattened_bucket")
    with pytest.raises(ValueError, match="bucket_format must be 'per_tensor'"):
        DistributedSender([], api="vllm", bucket_format="flattened_bucket")
    with pytest.raises(ValueError, match="api 'triton'"):
        DistributedSender([], api="triton")
    cfg = load_config(None, ["engine.weight_sync=distributed", "engine.api=vllm"])
    coord = Coordinator(TaskQueue(10), ExperienceBuffer(groups_per_step=1, max_staleness=1))
    sync = make_weight_sync(cfg, WeightStore(str(tmp_path / "store")), coord)
    try:
        assert sync.sender.api == "vllm" and not sync.sender.success_field
    finally:
        sync.close()


def _push(receiver: WeightReceiver, state: dict, names: list[str], version: int, group: str,
          sender: WeightGroup) -> object:  # fmt: skip
    """Rank 0 broadcasts `names` as one flattened bucket while the receiver takes it."""
    out: dict = {}
    metas = [TensorMeta(n, state[n].dtype, tuple(state[n].shape)) for n in names]

    def take() -> None:
        try:
            out["r"] = receiver.receive(names, [dtype_name(m.dtype) for m in metas],
                                        [list(m.shape) for m in metas], group, version,
                                        FLATTENED_BUCKET)  # fmt: skip
        except ValueError as e:  # raised here, on the test's thread
            out["e"] = e

    t = threading.Thread(target=take)
    t.start()
    sender.broadcast(flatten([state[n] for n in names]))
    t.join(timeout=60)
    if "e" in out:
        raise out["e"]
    return out["r"]


def _joined(engine: NativeEngine) -> tuple[WeightReceiver, WeightGroup]:
    """The engine's receiver as rank 1 and a sender as rank 0 of one gloo group "g"."""
    receiver = WeightReceiver(engine, timeout_s=30)
    # as a server's /health does: the receiving processes fork at once from here on
    assert GROUP_PROCESSES_READY.wait(180)
    port = free_port()
    t = threading.Thread(target=receiver.init_group, args=("127.0.0.1", port, 1, 2, "g", "gloo"))
    t.start()
    sender = WeightGroup("g", "gloo", "127.0.0.1", port, 0, 2, timeout_s=30)
    t.join()
    return receiver, sender


def test_receiver_applies_a_version_only_once_all_of_it_arrived() -> None:
    model = tiny_model(seed=0)
    engine = NativeEngine(model, EngineConfig(max_seq_len=64, kv_cache_tokens=512))
    try:
        receiver, sender = _joined(engine)
        assert receiver.groups() == ["g"]
        before = {k: v.clone() for k, v in model.state_dict().items()}
        new, _ = hf_weights(tiny_model(seed=1))
        names = list(new)
        half = len(names) // 2

        r = _push(receiver, new, names[:half], 5, "g", sender)
        assert not r.applied and r.staged == half and engine.version == 0
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        r = _push(receiver, new, names[half:], 5, "g", sender)
        assert r.applied and engine.version == 5
        assert torch.equal(model.state_dict()["model.norm.weight"], new["model.norm.weight"])

        # an incomplete version is discarded by the next one, never mixed into it
        v6, _ = hf_weights(tiny_model(seed=2))
        v7, _ = hf_weights(tiny_model(seed=3))
        r = _push(receiver, v6, names[:half], 6, "g", sender)
        assert not r.applied and engine.version == 5
        r = _push(receiver, v7, names[half:], 7, "g", sender)
        assert not r.applied and r.staged == len(names) - half and engine.version == 5
        r = _push(receiver, v7, names[:half], 7, "g", sender)
        assert r.applied and engine.version == 7
        got = receiver.weights_by_name(names[0], 5)
        assert got == v7[names[0]].reshape(-1)[:5].tolist()

        with pytest.raises(ValueError, match="unknown parameter names"):
            receiver.receive(["nope"], ["float32"], [[1]], "g", 8, None)
        with pytest.raises(ValueError, match="no weight update group"):
            receiver.receive(names[:1], ["float32"], [list(new[names[0]].shape)], "h", 8, None)
        sender.close()
        receiver.destroy_group("g")
        assert receiver.groups() == []
    finally:
        engine.close()


def _push_each(receiver: WeightReceiver, state: dict, version: int, group: str,
               sender: WeightGroup) -> object:  # fmt: skip
    """Rank 0 broadcasts every tensor of `state` on its own (SGLang's default format)."""
    out: dict = {}
    names = list(state)
    t = threading.Thread(target=lambda: out.update(r=receiver.receive(
        names, [dtype_name(state[n].dtype) for n in names], [list(state[n].shape) for n in names],
        group, version, None)))  # fmt: skip
    t.start()
    for n in names:
        sender.broadcast(state[n].contiguous())
    t.join(timeout=60)
    return out["r"]


def test_receiver_stages_in_the_models_layout_and_refuses_a_non_finite_version() -> None:
    """Per-tensor and flattened transfers, per-expert and fused names, another dtype: all land
    in one staging of the model's own layout, which exchanges storage with the parameters at
    each swap (no copy, no allocation); a NaN is refused with the served weights unchanged,
    and the next version still applies."""
    from slipstream.model.checkpoint import hf_from_internal

    model = tiny_model(seed=0)
    engine = NativeEngine(model, EngineConfig(max_seq_len=64, kv_cache_tokens=512))
    try:
        receiver, sender = _joined(engine)

        def expect(src: torch.nn.Module) -> None:
            want = src.state_dict()
            for k, v in model.state_dict().items():
                assert torch.equal(v, want[k].to(v.dtype)), k

        split, _ = hf_weights(tiny_model(seed=1))
        assert _push_each(receiver, split, 1, "g", sender).applied and engine.version == 1
        expect(tiny_model(seed=1))

        def buffers() -> set[int]:  # the staging's storage and the model's
            return {v.data_ptr() for v in receiver._staging.values()} | {
                v.data_ptr() for v in model.state_dict().values()
            }

        staging = buffers()

        src = tiny_model(seed=2)
        fused = hf_from_internal(dict(src.state_dict()), src.config, fused_experts=True)
        bf16 = {k: v.to(torch.bfloat16) for k, v in fused.items()}
        names = list(bf16)
        assert _push(receiver, bf16, names, 2, "g", sender).applied and engine.version == 2
        expect(src.to(torch.bfloat16))
        # double-buffered: staging and parameters exchange storage, nothing is allocated
        assert buffers() == staging

        before = {k: v.clone() for k, v in model.state_dict().items()}
        bad, _ = hf_weights(tiny_model(seed=3))
        bad["model.norm.weight"] = torch.full_like(bad["model.norm.weight"], float("inf"))
        with pytest.raises(ValueError, match="model.norm.weight.*NaN or inf"):
            _push(receiver, bad, list(bad), 3, "g", sender)
        assert engine.version == 2
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        good, _ = hf_weights(tiny_model(seed=4))
        assert _push(receiver, good, list(good), 4, "g", sender).applied and engine.version == 4
        expect(tiny_model(seed=4))

        name = "model.norm.weight"
        with pytest.raises(ValueError, match=r"model.norm.weight: shape \[3\], the model has"):
            receiver.receive([name], ["float32"], [[3]], "g", 5, None)
        sender.close()
    finally:
        engine.close()


def test_trainer_side_factory_stores_every_nth_refuses_nan_and_colocated_without_cuda(
    tmp_path,
) -> None:
    from slipstream.config import load_config
    from slipstream.rl.buffer import ExperienceBuffer
    from slipstream.rl.coordinator import Coordinator
    from slipstream.rl.publisher import Publisher
    from slipstream.rl.queue import TaskQueue
    from slipstream.rl.weight_sync import PushWeightSync, make_weight_sync
    from slipstream.storage import NonFiniteTensor, WeightStore

    store = WeightStore(str(tmp_path / "store"))
    coord = Coordinator(TaskQueue(10), ExperienceBuffer(groups_per_step=1, max_staleness=1))
    assert isinstance(make_weight_sync(load_config(None, []), store, coord), Publisher)
    cfg = load_config(None, ["engine.weight_sync=distributed", "engine.weight_store_every=3"])
    sync = make_weight_sync(cfg, store, coord)
    assert isinstance(sync, PushWeightSync)
    state, config = hf_weights(tiny_model(seed=0))
    try:
        for v in range(4):  # no engine registered: every version is stored (issue 44: a
            sync.submit(v, state, config)  # version that reached no engine must reach the
            assert coord.version() == v  # engines that register later)
            assert store.latest() == v
        # an engine that never answers stays out of the pushes; what reached nobody is stored
        coord.register_engine("w9.0", "http://127.0.0.1:9")
        sync.submit(4, state, config)
        assert store.latest() == 4 and sync.sender.dropped == ["http://127.0.0.1:9"]
        bad = {
            **state,
            "model.norm.weight": torch.full_like(state["model.norm.weight"], float("nan")),
        }
        with pytest.raises(NonFiniteTensor, match="refusing to push weights version 5"):
            sync.submit(5, bad, config)
        assert coord.version() == 4
    finally:
        sync.close()
    if not torch.cuda.is_available():
        cuda = load_config(None, ["engine.weight_sync=colocated", "engine.device=cuda"])
        with pytest.raises(ValueError, match="colocated.*needs a GPU"):
            make_weight_sync(cuda, store, coord)


def test_the_ipc_unpickler_takes_what_a_cuda_tensor_pickles_to_and_nothing_else() -> None:
    """`IpcSender`'s payload (ForkingPickler) for a CUDA tensor is `rebuild_cuda_tensor` with
    the tensor's class, size, stride, offset, storage class, dtype, device, handles (torch
    2.13's reduce_tensor; no CUDA here to make a real one): the engine's restricted unpickler
    must resolve every global of it, and refuse anything else."""
    import base64
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from slipstream.engine import weight_routes

    class CudaLike:  # what reduce_tensor returns for a CUDA tensor (handles are bytes)
        def __init__(self, cls: type) -> None:
            self.cls = cls

        def __reduce__(self):  # noqa: ANN204
            return (rebuild_cuda_tensor, (self.cls, torch.Size([4, 2]), (2, 1), 0,
                                          torch.storage.TypedStorage, torch.bfloat16, 0, b"h",
                                          16, 0, False, b"r", 0, b"e", True))  # fmt: skip

    class Probe(weight_routes._IPCUnpickler):
        def find_class(self, module: str, name: str):  # noqa: ANN201
            found = super().find_class(module, name)  # refuses what the server refuses
            return (lambda *args: args) if name == "rebuild_cuda_tensor" else found

    for cls in (torch.Tensor, torch.nn.Parameter):
        buf = io.BytesIO()
        ForkingPickler(buf).dump([("model.norm.weight", CudaLike(cls))])
        raw = base64.b64decode(base64.b64encode(buf.getvalue()))
        [(name, args)] = Probe(io.BytesIO(raw)).load()
        assert name == "model.norm.weight" and args[0] is cls and args[5] is torch.bfloat16

    class Evil:
        def __reduce__(self):  # noqa: ANN204
            import os

            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        weight_routes._IPCUnpickler(io.BytesIO(pickle.dumps([("x", Evil())]))).load()


def test_ipc_sender_refuses_tensors_off_the_gpu_before_sending_anything() -> None:
    """`IpcSender` (engine.weight_sync = "colocated") sends CUDA IPC handles: a CPU tensor has
    none, so it is refused naming the tensors, with nothing posted (its CUDA path is
    tests/gpu/test_gpu_weights.py, run by scripts/gpu-check.sh on a GPU)."""
    from slipstream.engine.weight_transport import IpcSender

    sender = IpcSender(["http://127.0.0.1:9"], timeout_s=1.0)
    try:
        state, _ = hf_weights(tiny_model(seed=0))
        with pytest.raises(ValueError, match="not on a GPU, e.g. .*model"):
            sender.send(1, state)
        assert sender.members == ["http://127.0.0.1:9"] and sender.dropped == []
    finally:
        sender.close()


class _Sender:
    """A WeightSender that serves every member at once (PushWeightSync's policy under test)."""

    def __init__(self) -> None:
        self.members: list[str] = []
        self.dropped: list[str] = []
        self.sent: list[tuple[int, list[str]]] = []

    def add_engine(self, url: str, api_key: str | None = None) -> None:
        self.members.append(url)

    def send(self, version: int, state: dict) -> object:
        from slipstream.engine.weight_transport import SendReport

        self.sent.append((version, list(self.members)))
        return SendReport(version, 1, 0.01, {u: 0.01 for u in self.members})

    def close(self) -> None:
        pass


def test_push_sync_hands_the_current_version_to_an_engine_that_joins_between_pushes(
    tmp_path,
) -> None:
    """Issue 44 (resume deadlock): an engine that registers after version v was pushed would
    wait for v + 1, which never comes when the trainer waits on its worker. While the trainer
    waits (`idle`), v is stored for it (the worker loads it) and it joins the next push; a
    version served by every engine is not stored again."""
    from slipstream.config import load_config
    from slipstream.rl.buffer import ExperienceBuffer
    from slipstream.rl.coordinator import Coordinator
    from slipstream.rl.queue import TaskQueue
    from slipstream.rl.weight_sync import PushWeightSync
    from slipstream.storage import WeightStore

    store = WeightStore(str(tmp_path / "store"), keep_last=100)
    coord = Coordinator(TaskQueue(10), ExperienceBuffer(groups_per_step=1, max_staleness=0))
    cfg = load_config(None, ["engine.weight_sync=distributed", "engine.weight_store_every=100"])
    sender = _Sender()
    sync = PushWeightSync(cfg, store, coord, sender)
    state, config = hf_weights(tiny_model(seed=0))
    coord.register_engine("w0.0", "http://a")
    sync.submit(0, state, config)  # the first version is always stored
    sync.submit(1, state, config)  # served by a: not stored
    sync.idle()  # nobody new: nothing stored
    assert store.versions() == [0]
    coord.register_engine("w0.1", "http://b")  # a replaced worker's engine, after the push
    sync.idle()
    assert store.versions() == [0, 1]  # b's worker loads exactly the current version
    sync.submit(2, state, config)
    assert sender.sent[-1] == (2, ["http://a", "http://b"])
    assert store.versions() == [0, 1]


def test_weights_by_name_needs_the_admin_key_and_is_capped() -> None:
    """Issue 44: /get_weights_by_name returned up to 2**20 values of any parameter without the
    admin key (the weights are the asset). Now it is an admin route and returns at most
    MAX_TRUNCATE_SIZE values."""
    from starlette.testclient import TestClient

    from slipstream.engine.guard import ServeOptions
    from slipstream.engine.server import create_app
    from slipstream.engine.weight_routes import MAX_TRUNCATE_SIZE

    engine = NativeEngine(tiny_model(seed=0), EngineConfig(max_seq_len=64, kv_cache_tokens=512))
    app = create_app(engine, options=ServeOptions(api_key="k3y"))
    body = {"name": "model.norm.weight", "truncate_size": 4}
    try:
        with TestClient(app) as client:
            assert client.post("/get_weights_by_name", json=body).status_code == 401
            assert client.get("/get_weights_by_name", params=body).status_code == 401
            ok = client.post("/get_weights_by_name", json=body,
                             headers={"Authorization": "Bearer k3y"})  # fmt: skip
            assert ok.status_code == 200 and len(ok.json()) == 4
            big = {**body, "truncate_size": MAX_TRUNCATE_SIZE + 1}
            resp = client.post("/get_weights_by_name", json=big,
                               headers={"Authorization": "Bearer k3y"})  # fmt: skip
            assert resp.status_code == 400
            # /health: 503 until the groups' receiving processes can start at once, then 200
            assert GROUP_PROCESSES_READY.wait(120)
            assert client.get("/health").status_code == 200
    finally:
        engine.close()


def test_weight_route_executor_refuses_beyond_its_threads_and_health_says_so() -> None:
    """The weight routes run on their own bounded executor: when every thread is held (by
    calls past their bound), the next call is refused at once and `degraded()` (what /health
    answers 503 with) names it; nothing queues on the server's default pool."""
    import asyncio

    from slipstream.engine.weight_routes import WEIGHT_ROUTE_THREADS, WeightRouteExecutor
    from slipstream.engine.weight_transport import warm_up_group_processes

    warm_up_group_processes()
    assert GROUP_PROCESSES_READY.wait(120)
    pool = WeightRouteExecutor(bound_s=0.0)
    release = threading.Event()

    async def main() -> None:
        held = [asyncio.ensure_future(pool.run("/init_weights_update_group", release.wait, 30))
                for _ in range(WEIGHT_ROUTE_THREADS)]  # fmt: skip
        while len(pool._running) < WEIGHT_ROUTE_THREADS:
            await asyncio.sleep(0.01)
        with pytest.raises(RuntimeError, match="weight routes are busy"):
            await pool.run("/get_weights_by_name", lambda: None)
        problem = pool.degraded()
        assert problem is not None and "past their bound" in problem
        release.set()
        await asyncio.gather(*held)
        assert pool.degraded() is None

    asyncio.run(main())


def test_a_real_ipc_payload_of_host_tensors_is_refused_by_the_engines_unpickler() -> None:
    """The CPU-testable half of the colocated (CUDA IPC) path, for real: `ipc_payload` (the
    sender's serialisation, SGLang's MultiprocessingSerializer's) of host tensors pickles them
    as shared-memory file descriptors, not CUDA handles, and the engine's restricted unpickler
    (`_load_ipc_tensors`, what /update_weights_from_tensor runs) refuses that payload naming
    the function, rebuilding nothing. What needs a GPU and was never run: a CUDA tensor's real
    handle rebuilt in another process (tests/gpu/test_gpu_weights.py, the device check)."""
    import pickle

    from slipstream.engine import weight_routes
    from slipstream.engine.weight_transport import ipc_payload

    state, _ = hf_weights(tiny_model(seed=0))
    payload = ipc_payload({"model.norm.weight": state["model.norm.weight"]})
    with pytest.raises(pickle.UnpicklingError, match="refusing torch.multiprocessing"):
        weight_routes._load_ipc_tensors([payload])
    with pytest.raises(ValueError, match="has 2 entries"):
        weight_routes._load_ipc_tensors([payload, payload])


def test_push_sync_to_an_external_server_pushes_per_expert_names_once_per_server(
    tmp_path,
) -> None:
    """engine.type = http (issue 44): the workers sharing one external server register its URL
    each; the server is added to the pushes once, every worker's served seconds are its; the
    trainer hands over (and stores) the checkpoint's per-expert names, what SGLang and vLLM
    load; the rendezvous is at engine.weight_sync_master_address. With a stage dir (the server
    cannot read the store) the trainer does not catch the server up from the store."""
    from slipstream.config import load_config
    from slipstream.model.checkpoint import read_safetensors_dir
    from slipstream.rl.buffer import ExperienceBuffer
    from slipstream.rl.coordinator import Coordinator
    from slipstream.rl.queue import TaskQueue
    from slipstream.rl.weight_sync import PushWeightSync, make_weight_sync
    from slipstream.storage import WeightStore

    store = WeightStore(str(tmp_path / "store"), keep_last=100)
    coord = Coordinator(TaskQueue(10), ExperienceBuffer(groups_per_step=1, max_staleness=0))
    http = ["engine.type=http", "engine.url=http://s:30000", "engine.weight_sync=distributed"]
    cfg = load_config(None, [*http, "engine.weight_sync_master_address=10.0.0.7"])
    made = make_weight_sync(cfg, store, coord)
    try:
        assert isinstance(made, PushWeightSync) and made.fused_experts is False
        assert made.sender.master_address == "10.0.0.7" and made.sender.catch_up is not None
    finally:
        made.close()
    staged = make_weight_sync(load_config(None, [*http, f"engine.weights_stage_dir={tmp_path}"]),
                              store, coord)  # fmt: skip
    try:
        assert staged.sender.catch_up is None
    finally:
        staged.close()
    sender = _Sender()
    sync = PushWeightSync(cfg, store, coord, sender)
    state, config = hf_weights(tiny_model(seed=0))
    assert any(".experts.0." in n for n in state)  # per-expert names, as the trainer hands them
    coord.register_engine("w0.0", "http://s:30000", None)
    coord.register_engine("w1.0", "http://s:30000", None)
    sync.submit(0, state, config)
    assert sender.members == ["http://s:30000"] and sender.sent == [(0, ["http://s:30000"])]
    assert sync.served_s == {"w0.0": 0.01, "w1.0": 0.01}
    stored = read_safetensors_dir(store.location(0))
    assert sorted(stored) == sorted(state)  # stored as handed over: a transformers checkpoint
