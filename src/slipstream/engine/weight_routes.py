"""The weight-transfer endpoints of `slipstream serve` (engine/weight_transport.py has the
protocols and the receiving end), so a trainer written for SGLang or for vLLM pushes into it:

- SGLang's: POST /init_weights_update_group, /update_weights_from_distributed,
  /destroy_weights_update_group, /update_weights_from_tensor (CUDA only), GET|POST
  /get_weights_by_name. Bodies and answers ({"success", "message"}) are SGLang's
  (python/sglang/srt/managers/io_struct.py).
- vLLM's (its dev-mode RLHF router, `vllm/entrypoints/serve/dev/rlhf/api_router.py`, NCCL
  backend): POST /init_weight_transfer_engine {"init_info": {master_address, master_port,
  rank_offset, world_size}}, /start_weight_update, /update_weights {"update_info": {names,
  dtype_names, shapes, packed}}, /finish_weight_update {"weight_version"}; GET /get_world_size,
  /weight_info. Answers {"message"} as vLLM's. One difference, said here and in docs/weights.md:
  vLLM's NCCL backend forms its own group (vLLM's StatelessProcessGroup + PyNccl), ours a torch
  process group; `init_info` takes our extra key `backend` ("gloo" on CPU, the default for a CPU
  engine; "nccl": torch's), and a CUDA engine asked without it refuses rather than wait on a
  rendezvous it cannot join. Packed (`packed: true`) transfers are refused.

The modifying ones are admin endpoints (guard.py).
"""

from __future__ import annotations

import asyncio
import base64
import io
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from slipstream.engine.guard import error_response
from slipstream.engine.protocol import Strict
from slipstream.engine.server_state import ServerState
from slipstream.engine.weight_transport import (
    DEFAULT_GROUP,
    GROUP_PROCESSES_READY,
    MAX_WEIGHT_GROUPS,
    VLLM_GROUP,
    WeightReceiver,
)

Name = Annotated[str, Field(min_length=1, max_length=512)]


class Rendezvous(Strict):
    """Where the trainer (rank 0) hosts a group's rendezvous, and this engine's rank in it: the
    fields SGLang's and vLLM's init requests share."""

    master_address: Annotated[str, Field(min_length=1, max_length=255)]
    master_port: Annotated[int, Field(ge=1, le=65535)]
    rank_offset: Annotated[int, Field(ge=1, le=65535)]
    world_size: Annotated[int, Field(ge=2, le=65536)]


class InitWeightsUpdateGroupReqInput(Rendezvous):
    group_name: Name = DEFAULT_GROUP
    backend: str = "nccl"


class DestroyWeightsUpdateGroupReqInput(Strict):
    group_name: Name = DEFAULT_GROUP


class UpdateWeightsFromDistributedReqInput(Strict):
    names: list[Name]
    dtypes: list[Annotated[str, Field(max_length=40)]]
    shapes: list[list[Annotated[int, Field(ge=0)]]]
    group_name: Name = DEFAULT_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class UpdateWeightsFromTensorReqInput(Strict):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class VllmInitInfo(Rendezvous):
    """vLLM's NCCLWeightTransferInitInfo, plus our `backend` (see the module docstring)."""

    backend: Literal["gloo", "nccl"] | None = None


class VllmInitRequest(Strict):
    init_info: VllmInitInfo


class VllmStartRequest(Strict):
    # older vLLM clients send it; our names are always the checkpoint's
    is_checkpoint_format: bool = True


class VllmUpdateInfo(Strict):
    """vLLM's NCCLWeightTransferUpdateInfo."""

    names: list[Name]
    dtype_names: list[Annotated[str, Field(max_length=40)]]
    shapes: list[list[Annotated[int, Field(ge=0)]]]
    packed: bool = False
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int | None = None


class VllmUpdateRequest(Strict):
    update_info: VllmUpdateInfo


class VllmFinishRequest(Strict):
    weight_version: str | None = None


MAX_TRUNCATE_SIZE = 4096
"""Most values /get_weights_by_name returns (a spot check of a parameter, as SGLang's tests use
it; the weights themselves travel through the store or a push, never through this route)."""


class GetWeightsByNameReqInput(Strict):
    name: Name
    truncate_size: Annotated[int, Field(ge=1, le=MAX_TRUNCATE_SIZE)] = 100


WEIGHT_ROUTE_THREADS = MAX_WEIGHT_GROUPS + 2
"""Threads of the weight routes' own executor: a rendezvous per group the engine may hold, a
transfer and a spot check; a request beyond them is answered 503 at once, never queued (and
never on the server's default thread pool, which the other routes use)."""


class WeightRouteExecutor:
    """The bounded executor the weight routes run their blocking work on (see
    WEIGHT_ROUTE_THREADS), and what /health reports of it: `degraded()` names the calls running
    past their bound (none should: every rendezvous and broadcast has a deadline)."""

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self._pool = ThreadPoolExecutor(WEIGHT_ROUTE_THREADS, thread_name_prefix="wroute")
        self._lock = threading.Lock()
        self._running: dict[int, tuple[str, float]] = {}
        self._next = 0

    async def run(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the executor; RuntimeError (-> 503) when every thread is busy."""
        with self._lock:
            if len(self._running) >= WEIGHT_ROUTE_THREADS:
                raise RuntimeError(
                    f"the weight routes are busy ({len(self._running)} calls in flight, at "
                    f"most {WEIGHT_ROUTE_THREADS}); retry later")  # fmt: skip
            key, self._next = self._next, self._next + 1
            self._running[key] = (what, time.monotonic())
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args))
        finally:
            with self._lock:
                self._running.pop(key, None)

    def degraded(self) -> str | None:
        """Why the weight routes cannot serve now, or None."""
        if not GROUP_PROCESSES_READY.is_set():
            return "weight routes starting (the forkserver of the groups' receiving processes)"
        now = time.monotonic()
        with self._lock:
            late = [(w, now - t0) for w, t0 in self._running.values() if now - t0 > self.bound_s]
            busy = len(self._running)
        if late:
            what, age = max(late, key=lambda x: x[1])
            return (f"weight routes degraded: {len(late)} call(s) past their bound of "
                    f"{self.bound_s:g} s (the oldest {what}, {age:.0f} s)")  # fmt: skip
        if busy >= WEIGHT_ROUTE_THREADS:
            return f"weight routes saturated: {busy} of {WEIGHT_ROUTE_THREADS} threads busy"
        return None


def add_weight_routes(app: FastAPI, state: ServerState, timeout_s: float) -> WeightRouteExecutor:
    """Add the endpoints; `timeout_s` bounds every collective this engine joins. Returns the
    routes' executor (/health asks it `degraded()`)."""
    receiver = WeightReceiver(state.engine, timeout_s=timeout_s)
    engine, options = state.engine, state.options
    # a transfer may hold a call for a bound per broadcast; /health flags one held far longer
    pool = WeightRouteExecutor(bound_s=4 * timeout_s + 60.0)
    app.state.weight_receiver = receiver

    def answer(ok: bool, message: str, status: int = 200) -> JSONResponse:
        if ok:
            return JSONResponse({"success": True, "message": message})
        return error_response(status, message, extra={"success": False, "message": message})

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(obj: InitWeightsUpdateGroupReqInput) -> JSONResponse:
        if obj.rank_offset >= obj.world_size:
            return answer(
                False, f"rank_offset {obj.rank_offset} >= world_size {obj.world_size}", 400
            )
        try:
            await pool.run("/init_weights_update_group", receiver.init_group, obj.master_address,
                           obj.master_port, obj.rank_offset, obj.world_size, obj.group_name,
                           obj.backend)  # fmt: skip
        except ValueError as e:
            return answer(False, f"Failed to init group: {e}", 400)
        except RuntimeError as e:  # rendezvous failed or timed out
            return answer(False, f"Failed to init group: {e}", 503)
        return answer(True, f"Succeeded to initialize custom process group {obj.group_name}.")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(obj: DestroyWeightsUpdateGroupReqInput) -> JSONResponse:
        try:
            await pool.run("/destroy_weights_update_group", receiver.destroy_group, obj.group_name)
        except ValueError as e:
            return answer(False, str(e), 400)
        except RuntimeError as e:
            return answer(False, str(e), 503)
        return answer(True, f"Succeeded to destroy custom process group {obj.group_name}.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(
        obj: UpdateWeightsFromDistributedReqInput,
    ) -> JSONResponse:
        try:  # SGLang's free-form labels too ("disk_update_v2.0.0"): weight_versions.py
            version, label = state.versions.resolve(obj.weight_version, engine.version, options)
        except ValueError as e:
            return answer(False, str(e), 400)
        if obj.abort_all_requests:
            engine.abort_all()
        try:
            result = await pool.run("/update_weights_from_distributed", receiver.receive,
                                    obj.names, obj.dtypes, obj.shapes, obj.group_name, version,
                                    obj.load_format)  # fmt: skip
        except ValueError as e:
            return answer(False, f"Failed to update parameter online: {e}", 400)
        except RuntimeError as e:
            return answer(False, f"Failed to update parameter online: {e}", 503)
        if result.applied:
            state.versions.set(version, label)
        return answer(True, result.message)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(obj: UpdateWeightsFromTensorReqInput) -> JSONResponse:
        device = next(engine.model.parameters()).device
        if device.type != "cuda":
            return answer(False, "update_weights_from_tensor (CUDA IPC, weight_sync = "
                          f"'colocated') needs a CUDA engine; this one runs on {device}", 400)  # fmt: skip
        try:
            version, label = state.versions.resolve(obj.weight_version, engine.version, options)
            named = _load_ipc_tensors(obj.serialized_named_tensors)  # pragma: no cover - CUDA
            result = await pool.run("/update_weights_from_tensor", receiver.receive_tensors,
                                    named, version)  # fmt: skip
        except (ValueError, pickle.UnpicklingError) as e:
            return answer(False, f"Failed to update weights: {e}", 400)
        except RuntimeError as e:
            return answer(False, f"Failed to update weights: {e}", 503)
        state.versions.set(version, label)
        return answer(True, result.message)

    # -- vLLM's weight-transfer API --

    def vllm_answer(message: str, status: int = 200) -> JSONResponse:
        if status == 200:
            return JSONResponse({"message": message})
        return error_response(status, message)

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(obj: VllmInitRequest) -> JSONResponse:
        info = obj.init_info
        if info.rank_offset >= info.world_size:
            return vllm_answer(f"rank_offset {info.rank_offset} >= world_size {info.world_size}",
                               400)  # fmt: skip
        backend = info.backend
        if backend is None:
            if next(engine.model.parameters()).device.type == "cuda":
                return vllm_answer(
                    "init_info has no 'backend': vLLM's NCCL backend forms vLLM's own PyNccl "
                    "group, which slipstream serve does not join; send backend 'nccl' (a torch "
                    "NCCL group, what slipstream's trainer forms) or use SGLang's "
                    "/init_weights_update_group", 400)  # fmt: skip
            backend = "gloo"
        if VLLM_GROUP in receiver.groups():  # vLLM replaces the engine's group on a new init
            receiver.destroy_group(VLLM_GROUP)
        try:
            await pool.run("/init_weight_transfer_engine", receiver.init_group,
                           info.master_address, info.master_port, info.rank_offset,
                           info.world_size, VLLM_GROUP, backend)  # fmt: skip
        except ValueError as e:
            return vllm_answer(f"Failed to init weight transfer: {e}", 400)
        except RuntimeError as e:  # rendezvous failed or timed out
            return vllm_answer(f"Failed to init weight transfer: {e}", 503)
        return vllm_answer("Weight transfer initialized")

    @app.post("/start_weight_update")
    async def start_weight_update(request: Request) -> JSONResponse:
        raw = await request.body()
        obj = VllmStartRequest.model_validate_json(raw) if raw.strip() else VllmStartRequest()
        if not obj.is_checkpoint_format:
            return vllm_answer("is_checkpoint_format false (kernel-format weights) is not "
                               "supported: send the checkpoint's names", 400)  # fmt: skip
        try:
            await pool.run("/start_weight_update", receiver.begin_update)
        except RuntimeError as e:
            return vllm_answer(str(e), 503)
        return vllm_answer("Weight update started")

    @app.post("/update_weights")
    async def update_weights(obj: VllmUpdateRequest) -> JSONResponse:
        info = obj.update_info
        if info.packed:
            return vllm_answer("packed weight transfers are not supported; send packed false "
                               "(one broadcast per tensor)", 400)  # fmt: skip
        try:
            await pool.run("/update_weights", receiver.receive, info.names, info.dtype_names,
                           info.shapes, VLLM_GROUP, None, None)  # fmt: skip
        except ValueError as e:
            return vllm_answer(f"Failed to update weights: {e}", 400)
        except RuntimeError as e:
            return vllm_answer(f"Failed to update weights: {e}", 503)
        return vllm_answer("Weights updated")

    @app.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> JSONResponse:
        raw = await request.body()
        obj = VllmFinishRequest.model_validate_json(raw) if raw.strip() else VllmFinishRequest()
        try:
            version, label = state.versions.resolve(obj.weight_version, engine.version, options)
            await pool.run("/finish_weight_update", receiver.finish_update, version)
        except ValueError as e:
            return vllm_answer(f"Failed to finish the weight update: {e}", 400)
        except RuntimeError as e:
            return vllm_answer(f"Failed to finish the weight update: {e}", 503)
        state.versions.set(version, label)
        return vllm_answer("Weight update finished")

    @app.get("/get_world_size")
    async def get_world_size() -> JSONResponse:
        return JSONResponse({"world_size": 1})  # one rank per engine (no tensor parallelism)

    @app.get("/weight_info")
    async def weight_info() -> JSONResponse:
        return JSONResponse({"weight_version": state.versions.label(engine.version)})

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> Any:
        raw = await request.body()
        obj = (GetWeightsByNameReqInput.model_validate_json(raw) if raw
               else GetWeightsByNameReqInput.model_validate(dict(request.query_params)))  # fmt: skip
        try:
            return await pool.run("/get_weights_by_name", receiver.weights_by_name, obj.name,
                                  obj.truncate_size)  # fmt: skip
        except RuntimeError as e:
            return error_response(503, str(e))

    return pool


# Only what a CUDA IPC tensor handle pickles to (torch.multiprocessing.reductions); anything
# else in the payload is refused, so an admin request can never run other code by unpickling.
_IPC_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.storage", "TypedStorage"), ("torch.storage", "UntypedStorage"),
    ("torch", "Size"), ("torch", "device"), ("collections", "OrderedDict"),
    ("torch._utils", "_rebuild_tensor_v2"),
    # the tensor's class, which rebuild_cuda_tensor rebuilds it as (reduce_tensor pickles
    # type(tensor)): classes only, never called with payload data but the rebuilt tensor
    ("torch", "Tensor"), ("torch.nn.parameter", "Parameter"),
}  # fmt: skip


class _IPCUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (
            (module, name) in _IPC_GLOBALS
            or (module == "torch" and name.endswith("dtype"))
            or (module == "torch" and name in ("float32", "float16", "bfloat16", "float64"))
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing {module}.{name} in a CUDA IPC payload")


def _load_ipc_tensors(payloads: list[str]) -> dict[str, Any]:  # pragma: no cover - CUDA only
    """SGLang's serialized_named_tensors (base64 of a pickled [(name, tensor)] whose tensors are
    CUDA IPC handles; one entry per TP rank, we have one) as {name: tensor}."""
    if len(payloads) != 1:
        raise ValueError(f"serialized_named_tensors has {len(payloads)} entries; this engine "
                         "has one rank")  # fmt: skip
    items = _IPCUnpickler(io.BytesIO(base64.b64decode(payloads[0]))).load()
    return dict(items)
