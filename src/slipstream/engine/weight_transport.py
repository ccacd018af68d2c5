"""Weights over the wire: SGLang's distributed weight-update protocol (and vLLM's weight-transfer
API, below), engine side and trainer side, over a torch process group (gloo on CPU, NCCL between
GPUs).

The protocol (SGLang's `python/sglang/srt/managers/io_struct.py`, same JSON on our server):
- `POST /init_weights_update_group` {master_address, master_port, rank_offset, world_size,
  group_name, backend}: the engine joins a new process group as rank `rank_offset`; rank 0 is
  the trainer, which hosts the rendezvous (a TCPStore) at master_address:master_port.
- `POST /update_weights_from_distributed` {names, dtypes, shapes, group_name, flush_cache,
  weight_version, load_format}: the engine receives those tensors from rank 0, one broadcast per
  tensor, or, with load_format "flattened_bucket", ONE broadcast of all of them concatenated
  (they then share one dtype: the sender's buckets are dtype-grouped).
- `POST /destroy_weights_update_group` {group_name}; `GET /get_weights_by_name` {name,
  truncate_size} (the first truncate_size values of the parameter, flattened).

Versions stay exact: the engine stages what it receives for a weight_version and swaps the whole
version in (`NativeEngine.swap_weights`, between decode steps) only once every parameter of
the model has arrived; a request for another version discards an incomplete staging. So a
version split over many bucket requests is never served half-applied (SGLang applies each request
as it arrives: a sender that wants exactness there sends one version per request set and waits).

vLLM's weight-transfer API (`DistributedSender(api="vllm")`; engine/weight_routes.py has the
bodies): `POST /init_weight_transfer_engine` {"init_info": {master_address, master_port,
rank_offset, world_size}} joins the group (vLLM names none: one per engine, replaced by the next
init); a version is `POST /start_weight_update`, one `POST /update_weights` {"update_info":
{names, dtype_names, shapes, packed: false}} per bucket (one broadcast per tensor, in order), and
`POST /finish_weight_update` {"weight_version"}, which is when our engine swaps the staged
version in (vLLM loads each tensor as it lands; the trainer pauses generation around the update
if it wants no mix, as TRL does). A vLLM server's NCCL group is vLLM's own PyNccl group, which the
trainer forms with vLLM's code (`VllmNcclGroup`); over gloo only `slipstream serve` answers.

Elasticity (trainer side, `DistributedSender`): every membership change opens a new group (a new
group_name and port: one per membership epoch), so no group is ever reused after a member was
lost. A transfer that fails or exceeds `timeout_s` closes the trainer's end (which unblocks the
survivors), probes every engine's /health, drops the ones that do not answer, and retries the
version once on a new group of the survivors. A dropped (or newly added) engine is brought to
the newest version in the store (`/update_weights_from_disk`) when it answers again, and joins
at the next version.

Not covered: tensor-parallel engines (one rank per engine), NIXL/RDMA, deltas.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

DEFAULT_GROUP = "weight_update_group"
VLLM_GROUP = "vllm-weight-transfer"
"""The group of vLLM's protocol, which names none (one per engine; a new init replaces it)."""
_PENDING = -1  # the staged version of a vLLM update until /finish_weight_update names it
MAX_ENGINES = 256
"""Engines one `DistributedSender` pushes to (one HTTP request thread each during a push)."""
FLATTENED_BUCKET = "flattened_bucket"
# The dtypes a weight may travel as (a name of torch's, as SGLang sends them: "bfloat16").
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (what SGLang's clients send in `dtypes`)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """ValueError unless `name` is a floating dtype a weight may travel as."""
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype {str(name)[:40]!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[key]


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Dtype-grouped buckets of at most `bucket_bytes` each (a tensor larger than that travels
    alone), in the order of `metas` within a dtype: one flattened broadcast per bucket."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    by_dtype: dict[torch.dtype, list[TensorMeta]] = {}
    for m in metas:
        by_dtype.setdefault(m.dtype, []).append(m)
    buckets: list[list[TensorMeta]] = []
    for group in by_dtype.values():
        cur: list[TensorMeta] = []
        size = 0
        for m in group:
            if cur and size + m.nbytes > bucket_bytes:
                buckets.append(cur)
                cur, size = [], 0
            cur.append(m)
            size += m.nbytes
        if cur:
            buckets.append(cur)
    return buckets


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D tensor of the tensors' values (they share one dtype)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, metas: Sequence[TensorMeta]) -> dict[str, torch.Tensor]:
    """The named tensors of `flatten` output (views into `flat`)."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for m in metas:
        n = m.nbytes // m.dtype.itemsize
        out[m.name] = flat[offset : offset + n].view(m.shape)
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flattened bucket holds {flat.numel()} values, metas name {offset}")
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for a new group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def form_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float,
) -> Any:
    """A process group formed the way SGLang's engine (`sglang.srt.utils`
    `init_custom_process_group`, called by `/init_weights_update_group`) and the trainers that
    push to SGLang (OpenRLHF, SkyRL, open-instruct, PipelineRL: copies of that function) form
    it: torch's `tcp://master_address:master_port` rendezvous (rank 0 hosts the TCPStore; every
    rank registers as a worker), the store prefixed with `group_name`, and
    `_new_process_group_helper` (the key layout of this torch version's groups). So either end
    may be ours or theirs. Rank 0's store waits until every rank registered, or `timeout_s`."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=timeout_s)
    # A group of this name closed a moment ago is torn down on a daemon thread (`_abort`), which
    # takes it out of torch's registry of names; until then torch refuses the name ("already
    # created": the sender re-forming its group after dropping an engine raced that thread).
    deadline = time.monotonic() + timeout_s
    while group_name in _world.pg_names.values():
        if time.monotonic() > deadline:
            raise RuntimeError(f"group {group_name!r}: the previous group of that name is still "
                               f"being torn down after {timeout_s:g} s")  # fmt: skip
        time.sleep(0.01)
    store, rank, world_size = next(rendezvous(f"tcp://{_host(master_address)}:{master_port}",
                                              rank, world_size, timeout=timeout))  # fmt: skip
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, backend_options=None,
                                      timeout=timeout)  # fmt: skip
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


class WeightGroup:
    """One process group of a membership epoch, formed as SGLang forms it (`form_group`):
    rank 0 (the trainer) hosts the rendezvous; every collective is bounded by `timeout_s`
    (gloo/NCCL raise after it)."""

    def __init__(
        self,
        name: str,
        backend: str,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r} is not 'gloo' or 'nccl'")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA; this process has no GPU (use 'gloo')")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.name, self.backend, self.rank, self.world_size = name, backend, rank, world_size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
            else torch.device("cpu")  # fmt: skip
        self._pg: Any = form_group(backend, master_address, master_port, rank, world_size,
                                   name, timeout_s)  # fmt: skip

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast from rank 0 into `tensor` (in place on other ranks); raises on a peer
        lost or after the timeout."""
        self._pg.broadcast([tensor], _root0()).wait(self.timeout)

    def broadcast_async(self, tensor: torch.Tensor) -> Any:
        return self._pg.broadcast([tensor], _root0())

    def wait(self, work: Any) -> None:
        work.wait(self.timeout)

    def close(self) -> None:
        """Drop this end: peers blocked in a collective of the group get an error. The abort
        runs on a daemon thread: tearing a group down can wait on a peer that is stopped or
        gone (an engine receiving many per-tensor broadcasts was wedged for minutes by it),
        and nobody should wait on that."""
        pg, self._pg = self._pg, None
        if pg is not None:
            holder = [pg]
            del pg  # the reaper holds the last reference: the destructor runs on its thread
            threading.Thread(target=_abort, args=(self.name, holder), daemon=True,
                             name=f"abort-{self.name}").start()  # fmt: skip


def _abort(name: str, holder: list[Any]) -> None:
    import torch.distributed as dist

    try:
        holder[0].abort()
    except (RuntimeError, AttributeError) as e:  # an already-broken group
        log.debug("group %s: abort: %s", name, e)
    try:  # out of torch's registry of groups (form_group put it there), so it can be freed
        dist.destroy_process_group(holder[0])
    except (RuntimeError, ValueError, KeyError, AssertionError) as e:
        log.debug("group %s: destroy: %s", name, e)
    holder.clear()


def _root0() -> Any:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return opts


# ---- the engine's end of a gloo group, in a process of its own --------------------------------

SPAWN_TIMEOUT_S = 60.0
"""How long a receiving process may take to start before it counts as failed (forked from a
server process that imported torch already: milliseconds, unless the first one starts it)."""
_CONTEXT: Any = None
_CONTEXT_LOCK = threading.Lock()


def _process_context() -> Any:
    """multiprocessing's forkserver, its server preloaded with this module (and torch): a
    receiving process is forked from it in milliseconds (spawning one imports torch: seconds,
    longer than a sender waits at a rendezvous), from a process with no threads (forking the
    server itself would copy its threads' locks)."""
    global _CONTEXT
    import multiprocessing as mp

    with _CONTEXT_LOCK:
        if _CONTEXT is None:
            ctx = mp.get_context("forkserver")
            # and __main__ (the `slipstream` script): else each child re-imports it to run
            ctx.set_forkserver_preload(["__main__", __name__])
            _CONTEXT = ctx
        return _CONTEXT


def warm_up_group_processes() -> None:
    """Start the forkserver now (in the background: a second or two), so the first
    /init_weights_update_group forks at once."""
    from multiprocessing import forkserver

    ctx = _process_context()

    def start() -> None:
        try:
            forkserver.ensure_running()
            # the server answers once its preload (torch, this module) is imported: a first
            # process started and ended is the sign (ensure_running returns before that)
            proc = ctx.Process(target=_noop, name="wgroup-warmup", daemon=True)
            proc.start()
            proc.join()
        except Exception as e:  # noqa: BLE001 - the first group then starts it (and says why)
            log.warning("could not start the weight groups' forkserver: %s", e)
        GROUP_PROCESSES_READY.set()

    if not GROUP_PROCESSES_READY.is_set():
        threading.Thread(target=start, daemon=True, name="wgroup-forkserver").start()


def _noop() -> None:
    pass


GROUP_PROCESSES_READY = threading.Event()
"""Set once the forkserver runs (`warm_up_group_processes`): until then a group's receiving
process would take seconds to start, longer than a sender waits at its rendezvous, so /health
says the weight routes are starting."""


class GroupProcess:
    """The engine's end of a gloo weight-update group, run in a child process of its own, so a
    group member can never take the server down or hold it past its bounds:
    - gloo checks a broadcast's size on its transport thread and aborts the whole process
      (`std::terminate`) when more bytes arrive than the receiver posted (a sender that
      declared [64, 32] float32 and broadcasts float64, or its tensors in another order): that
      kills this child, and the receive fails with 503 naming it;
    - torch's TCPStore client has no deadline on its handshake (a rendezvous that accepts and
      stays silent held `/init_weights_update_group` for minutes past its timeout): the child is
      killed at the deadline.
    The child receives into a shared-memory buffer (`SharedMemory`, grown on demand to the
    largest request) the parent then copies into its staging. CPU (gloo) only: an NCCL group
    receives into the device in-process (`WeightGroup`)."""

    def __init__(self, name: str, master_address: str, master_port: int, rank: int,
                 world_size: int, timeout_s: float) -> None:  # fmt: skip
        self._proc: Any = None  # close() may run on an instance whose start failed
        if not 0 < rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size} (rank 0 sends)")
        self.name, self.backend, self.device = name, "gloo", torch.device("cpu")
        self.timeout_s = timeout_s
        self._shm: Any = None
        self._buf: Any = None
        ctx = _process_context()
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_group_main, name=f"wgroup-{name}", daemon=True,
                                 args=(child, master_address, master_port, rank, world_size,
                                       name, timeout_s, os.getpid()))  # fmt: skip
        self._proc.start()
        child.close()
        try:
            self._expect("started", SPAWN_TIMEOUT_S, "start")
            self._expect("joined", timeout_s, "join the group (rendezvous at "
                         f"{master_address}:{master_port})")  # fmt: skip
        except BaseException:
            self.close()
            raise

    def _expect(self, what: str, timeout_s: float, doing: str) -> Any:
        """The child's next message, which must be `what`; RuntimeError (the child killed) on
        its error, its death or `timeout_s` without an answer."""
        try:
            ready = self._conn.poll(timeout_s)
            msg = self._conn.recv() if ready else None
        except (EOFError, OSError):
            msg = ("died", None)
        if msg is not None and msg[0] == what:
            return msg[1]
        proc = self._proc
        self.close()
        if msg is None:
            raise RuntimeError(f"group {self.name!r}: did not {doing} within {timeout_s:g} s; "
                               "its receiving process was killed")  # fmt: skip
        if msg[0] == "died":
            code = proc.exitcode if proc is not None else None
            raise RuntimeError(
                f"group {self.name!r}: its receiving process died (exit {code}) while trying to "
                f"{doing}: gloo aborts when a broadcast is larger than the receiver declared "
                "(another dtype or shape than the request named, or tensors out of order)"
            )
        raise RuntimeError(f"group {self.name!r}: could not {doing}: {msg[1]}")

    def buffer(self, nbytes: int) -> torch.Tensor:
        """The shared receive buffer (uint8), at least `nbytes` long (grown: a new one)."""
        from multiprocessing import shared_memory

        if self._proc is None:
            raise RuntimeError(f"group {self.name!r} is closed")
        if self._shm is None or self._shm.size < nbytes:
            old = self._shm
            self._shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
            self._buf = torch.frombuffer(self._shm.buf, dtype=torch.uint8)
            self._conn.send(("buffer", self._shm.name))
            if old is not None:
                _release(old)
        return self._buf

    def receive(self, sizes: Sequence[tuple[int, int, str]]) -> None:
        """One broadcast per (offset, nbytes, dtype) into `buffer()`; RuntimeError (the group
        is then closed) when the child failed, died or exceeded its bound."""
        if self._proc is None:
            raise RuntimeError(f"group {self.name!r} is closed")
        self._conn.send(("recv", list(sizes)))
        budget = self.timeout_s * max(1, len(sizes)) + 10.0
        self._expect("received", budget, f"receive {len(sizes)} broadcasts")

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.is_alive():
            try:
                self._conn.send(("close", None))
            except OSError:
                pass
            proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        if self._shm is not None:
            self._buf = None
            _release(self._shm)
            self._shm = None
        self._conn.close()


def _release(shm: Any) -> None:
    try:
        shm.close()
    except BufferError:  # a view still exported: the mapping goes with the last one
        pass
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


def _group_main(conn: Any, master_address: str, master_port: int, rank: int, world_size: int,
                name: str, timeout_s: float, server_pid: int) -> None:  # fmt: skip
    """The receiving process of a `GroupProcess`: joins the group, then receives what the
    parent asks for into the shared buffer it names, until told to close or the server goes
    (it is the forkserver's child, not the server's: a watchdog ends it when the server is
    gone, also mid-broadcast)."""
    from multiprocessing import shared_memory

    def watchdog() -> None:
        while True:
            time.sleep(0.5)
            try:
                os.kill(server_pid, 0)
            except ProcessLookupError:
                os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    torch.set_num_threads(1)
    conn.send(("started", None))
    try:
        pg = form_group("gloo", master_address, master_port, rank, world_size, name, timeout_s)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which answers the request
        conn.send(("error", f"{type(e).__name__}: {e}"[:500]))
        return
    conn.send(("joined", None))
    timeout = datetime.timedelta(seconds=timeout_s)
    shm, buf = None, None
    while True:
        try:
            kind, arg = conn.recv()
        except (EOFError, OSError):  # the server is gone
            return
        if kind == "close":
            return
        if kind == "buffer":
            buf = None
            if shm is not None:
                shm.close()
            shm = shared_memory.SharedMemory(name=arg)  # the parent owns (and unlinks) it
            buf = torch.frombuffer(shm.buf, dtype=torch.uint8)
            continue
        assert buf is not None
        try:
            for offset, nbytes, dtype in arg:
                view = buf[offset : offset + nbytes].view(parse_dtype(dtype))
                pg.broadcast([view], _root0()).wait(timeout)
        except Exception as e:  # noqa: BLE001 - the group is broken: say so and leave
            conn.send(("error", f"{type(e).__name__}: {e}"[:500]))
            return
        conn.send(("received", None))


# ---- engine side -------------------------------------------------------------------------------


_UNFILLED = 0xFF
"""Set as the last byte of each region before a receive: still there after it, fewer bytes
arrived than declared (little-endian: the top byte of the last value; 0xff there is a NaN or
inf in float16, |x| >= 2**127 in float32 and bfloat16, never a weight)."""
MAX_WEIGHT_GROUPS = 4
"""Weight update groups one engine holds at once, joined or joining (each is a receiving
process with its threads, sockets and shared buffer; a sender needs one per membership epoch,
and destroys the old one)."""
CHECK_CHUNK_BYTES = 64 * 2**20
"""The receiver checks what landed for NaN/inf per this many bytes (one fused norm each)."""


def _non_finite(tensors: Mapping[str, torch.Tensor], what: str) -> str | None:
    """None when every value is finite, else `storage.check_finite`'s message naming the tensor."""
    from slipstream.storage import NonFiniteTensor, check_finite

    try:
        check_finite(tensors, what)
    except NonFiniteTensor as e:
        return str(e)
    return None


@dataclass
class ReceiveResult:
    version: int
    applied: bool
    staged: int
    expected: int

    @property
    def message(self) -> str:
        if self.applied:
            return f"Succeeded to update parameter online (version {self.version})."
        return (f"Succeeded to receive {self.staged} of {self.expected} tensors of version "
                f"{self.version}; it is applied once all have arrived.")  # fmt: skip


class WeightReceiver:
    """The engine's end of SGLang's distributed protocol (see the module docstring), over one
    `NativeEngine`. Thread-safe: the server calls it from worker threads.

    What arrives goes straight into a staging copy of the model's parameters, in the model's own
    layout and dtype (each HF name, per-expert or fused, is a view of it: `hf_from_internal`),
    allocated at the first transfer: a version costs one copy out of each flattened bucket (none
    for per-tensor broadcasts of the model's dtype) and one finite check (per 64 MiB, on a
    thread while the next tensors land), and the swap exchanges
    the staging's storage with the parameters' (copies where CUDA graphs captured their
    addresses), so the staging then holds the previous version for the next to overwrite; no
    stacking of experts, no allocation per version. The staging holds one more copy of the
    model's weights on the engine's device for the engine's lifetime (SGLang instead loads each
    request into the live weights, so a version split over requests is served half-applied)."""

    def __init__(self, engine: Any, *, timeout_s: float = 120.0) -> None:
        from slipstream.model.checkpoint import hf_from_internal

        self.engine = engine
        self.timeout_s = timeout_s
        self._groups: dict[str, WeightGroup | GroupProcess] = {}
        self._joining: set[str] = set()  # groups whose rendezvous is in progress
        self._lock = threading.Lock()  # the groups dict
        # one transfer at a time, and the staging with it: two requests receiving concurrently
        # would take each other's broadcasts (a collective matches calls by order, not by name)
        self._transfer = threading.Lock()
        internal = dict(engine.model.state_dict())
        cfg = engine.model.config
        self._expected_split = frozenset(hf_from_internal(internal, cfg, fused_experts=False))
        self._expected_fused = frozenset(hf_from_internal(internal, cfg, fused_experts=True))
        self._known = self._expected_split | self._expected_fused
        self._staging: dict[str, torch.Tensor] = {}  # internal name -> tensor (lazily)
        self._views: dict[str, torch.Tensor] = {}  # HF name (split or fused) -> view of it
        self._flat: torch.Tensor | None = None  # the receive buffer of flattened buckets
        # finite checks of what landed, while the next tensors arrive (`_receive`)
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="wcheck")
        warm_up_group_processes()
        self._arrived: set[str] = set()
        self._staged_version: int | None = None

    def init_group(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str, backend: str) -> None:  # fmt: skip
        """Join a group as rank `rank_offset`, formed as SGLang forms it (`form_group`): over
        gloo in a receiving process of its own (`GroupProcess`), over NCCL in-process.
        Returns once every rank joined; RuntimeError after `timeout_s` (the receiving process
        killed: a hard deadline), ValueError for a bad request or one group too many
        (`MAX_WEIGHT_GROUPS`, joined or joining)."""
        if rank_offset < 1:
            raise ValueError(f"rank_offset {rank_offset} must be >= 1 (rank 0 is the sender)")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r} is not 'gloo' or 'nccl'")
        with self._lock:
            if group_name in self._groups or group_name in self._joining:
                raise ValueError(f"group {group_name!r} exists; destroy it first")
            if len(self._groups) + len(self._joining) >= MAX_WEIGHT_GROUPS:
                raise ValueError(
                    f"this engine holds {len(self._groups) + len(self._joining)} weight update "
                    f"groups (at most {MAX_WEIGHT_GROUPS}, each a process with its threads and "
                    "sockets); destroy one first")  # fmt: skip
            self._joining.add(group_name)
        try:
            group: WeightGroup | GroupProcess
            if backend == "gloo":
                group = GroupProcess(group_name, master_address, master_port, rank_offset,
                                     world_size, self.timeout_s)  # fmt: skip
            else:  # pragma: no cover - CUDA only
                group = WeightGroup(group_name, backend, master_address, master_port,
                                    rank_offset, world_size, self.timeout_s)  # fmt: skip
        finally:
            with self._lock:
                self._joining.discard(group_name)
        with self._lock:
            self._groups[group_name] = group

    def destroy_group(self, group_name: str) -> None:
        with self._lock:
            group = self._groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"no weight update group {group_name!r}")
        group.close()

    def groups(self) -> list[str]:
        with self._lock:
            return sorted(self._groups)

    def begin_update(self) -> None:
        """vLLM's /start_weight_update: a new update whose version is named when it ends
        (`finish_update`); whatever was staged before is dropped."""
        with self._transfer:
            self._arrived, self._staged_version = set(), _PENDING

    def finish_update(self, version: int) -> ReceiveResult:
        """vLLM's /finish_weight_update: serve what the update since `begin_update` staged, as
        `version`. ValueError (the served weights unchanged) when no update was begun or not
        every parameter of the model arrived."""
        with self._transfer:
            if self._staged_version != _PENDING:
                raise ValueError("no weight update in progress; POST /start_weight_update first")
            staged, expected = len(self._arrived), len(self._expected_split)
            if not (self._expected_split <= self._arrived or self._expected_fused <= self._arrived):
                self._arrived, self._staged_version = set(), None
                raise ValueError(f"the update holds {staged} of the model's parameters, not all "
                                 f"({expected} per-expert names or the stacked ones); the "
                                 "served weights are unchanged")  # fmt: skip
            self._arrived, self._staged_version = set(), None
            self._swap(version)
        return ReceiveResult(version, True, staged, expected)

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                group_name: str, version: int | None, load_format: str | None) -> ReceiveResult:  # fmt: skip
        """Receive the named tensors from rank 0 of `group_name`; stage them under `version`
        and apply the version when complete (SGLang). `version` None: stage them into the
        update `begin_update` opened, applied by `finish_update` (vLLM). ValueError for a bad
        request (nothing received); RuntimeError when the transfer failed (the group is then
        closed: the sender rebuilds)."""
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise ValueError(f"names, dtypes, shapes must be non-empty and of one length "
                             f"(got {len(names)}, {len(dtypes)}, {len(shapes)})")  # fmt: skip
        metas = [TensorMeta(n, parse_dtype(d), tuple(int(x) for x in s))
                 for n, d, s in zip(names, dtypes, shapes, strict=True)]  # fmt: skip
        unknown = [m.name for m in metas if m.name not in self._known]
        if unknown:
            raise ValueError(f"unknown parameter names {unknown[:5]}")
        if load_format not in (None, "auto", FLATTENED_BUCKET):
            raise ValueError(f"load_format {load_format!r} is not supported "
                             f"(None or {FLATTENED_BUCKET!r})")  # fmt: skip
        if load_format == FLATTENED_BUCKET and len({m.dtype for m in metas}) != 1:
            raise ValueError("a flattened bucket must hold tensors of one dtype")
        with self._lock:
            group = self._groups.get(group_name)
        if group is None:
            raise ValueError(f"no weight update group {group_name!r}; "
                             "POST /init_weights_update_group first")  # fmt: skip
        with self._transfer:
            views = self._staging_views()
            bad_shape = [(m.name, m.shape, tuple(views[m.name].shape)) for m in metas
                         if m.shape != tuple(views[m.name].shape)]  # fmt: skip
            if bad_shape:
                name, got, want = bad_shape[0]
                raise ValueError(f"{name}: shape {list(got)}, the model has {list(want)}")
            if version is None and self._staged_version != _PENDING:
                raise ValueError("no weight update in progress; POST /start_weight_update first")
            if version is not None and self._staged_version != version:
                # a new version: what was staged is dropped
                self._arrived, self._staged_version = set(), version
            try:
                self._receive(group, group_name, metas, load_format, views)
            except (RuntimeError, ValueError):  # failed, or not finite: this version is void
                self._arrived, self._staged_version = set(), None
                raise
            self._arrived.update(m.name for m in metas)
            staged = len(self._arrived)
            expected = len(self._expected_split)
            if version is None:  # vLLM: applied by finish_update
                return ReceiveResult(self.engine.version, False, staged, expected)
            if not (self._expected_split <= self._arrived or self._expected_fused <= self._arrived):
                return ReceiveResult(version, False, staged, expected)
            self._arrived, self._staged_version = set(), None
            self._swap(version)
        return ReceiveResult(version, True, staged, expected)

    def _staging_views(self) -> dict[str, torch.Tensor]:
        """Under the transfer lock: the HF-named views of the staging (allocated once)."""
        from slipstream.model.checkpoint import hf_from_internal

        if not self._staging:
            model = self.engine.model
            self._staging = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
            if model.config.tie_word_embeddings:  # one tensor, staged under its embedding name
                self._staging.pop("lm_head.weight", None)
        if not self._views:  # (again after an exchange: the staging holds other storage)
            cfg = self.engine.model.config
            self._views = {**hf_from_internal(self._staging, cfg, fused_experts=False),
                           **hf_from_internal(self._staging, cfg, fused_experts=True)}  # fmt: skip
        return self._views

    def _swap(self, version: int) -> None:
        """Under the transfer lock (nothing writes the staging until the engine took it).
        Every staged tensor was checked finite as it landed (`_receive`)."""
        from slipstream.engine.weights import PreparedWeights

        # exchanged, not copied (where the engine allows it): the staging then holds the
        # previous version's storage, which the next version overwrites
        self._views = {}
        self.engine.swap_weights(version, PreparedWeights(dict(self._staging)), exchange=True)

    def _receive(self, group: WeightGroup | GroupProcess, group_name: str, metas: list[TensorMeta],
                 load_format: str | None, views: dict[str, torch.Tensor]) -> None:  # fmt: skip
        """Receive into the staging views, checking them finite per CHECK_CHUNK_BYTES as they
        land, on the checker thread while the next tensors arrive (inline, each check held up
        the sender's next broadcast: a receiver that has not posted its receive stalls the
        collective). ValueError naming a non-finite tensor, after the whole request was
        received (the collective stays in step); its version is then dropped from the
        staging."""
        chunk: dict[str, torch.Tensor] = {}
        checks: list[Future] = []
        what = ("the weight update in progress" if self._staged_version == _PENDING
                else f"weight version {self._staged_version}")  # fmt: skip

        def check() -> None:
            if chunk:  # the views stay untouched until the swap, after every check ended
                checks.append(self._checker.submit(_non_finite, dict(chunk), what))
                chunk.clear()

        try:
            self._receive_into(group, metas, load_format, views, chunk, check)
        except RuntimeError as e:
            for f in checks:
                f.result()
            self._drop(group_name)
            raise RuntimeError(f"receiving from group {group_name!r} failed ({e}); the group "
                               "is closed, the served weights are unchanged") from e  # fmt: skip
        check()
        found = [b for f in checks if (b := f.result()) is not None]  # every check has ended
        if found:
            raise ValueError(found[0])

    def _receive_into(self, group: WeightGroup | GroupProcess, metas: list[TensorMeta], load_format: str | None,
                      views: dict[str, torch.Tensor], chunk: dict[str, torch.Tensor],
                      check: Callable[[], None]) -> None:  # fmt: skip
        """`_receive`'s transfer: into the views, `chunk` filled as tensors land, `check()` per
        CHECK_CHUNK_BYTES (it takes the chunk and starts a new one)."""
        if isinstance(group, GroupProcess):
            self._receive_by_process(group, metas, load_format, views, chunk, check)
            return
        chunk_bytes = 0
        if load_format == FLATTENED_BUCKET:  # pragma: no cover - NCCL (in-process) only
            numel = sum(m.nbytes for m in metas) // metas[0].dtype.itemsize
            flat = self._flat
            if flat is None or flat.dtype != metas[0].dtype or flat.numel() < numel \
                    or flat.device != group.device:  # fmt: skip
                flat = self._flat = torch.empty(numel, dtype=metas[0].dtype,
                                                device=group.device)  # fmt: skip
            group.broadcast(flat[:numel])
            for name, t in unflatten(flat[:numel], metas).items():
                views[name].copy_(t)
            chunk.update({m.name: views[m.name] for m in metas})
        else:  # pragma: no cover - NCCL (in-process) only
            # straight into the staging where dtype and device match (views are contiguous)
            direct = {m.name: views[m.name] if views[m.name].dtype == m.dtype
                      and views[m.name].device == group.device
                      and views[m.name].is_contiguous()
                      else torch.empty(m.shape, dtype=m.dtype, device=group.device)
                      for m in metas}  # fmt: skip
            # one collective in flight at a time: with many queued, a peer lost mid-way
            # left gloo's wait() blocked past its timeout and the group's abort with it
            for name, t in direct.items():
                group.broadcast(t)
                if t is not views[name]:
                    views[name].copy_(t)
                chunk[name] = views[name]
                chunk_bytes += t.numel() * t.element_size()
                if chunk_bytes >= CHECK_CHUNK_BYTES:
                    check()
                    chunk_bytes = 0

    def _receive_by_process(self, group: GroupProcess, metas: list[TensorMeta],
                            load_format: str | None, views: dict[str, torch.Tensor],
                            chunk: dict[str, torch.Tensor], check: Callable[[], None]) -> None:  # fmt: skip
        """Over gloo: the group's process receives the request into its shared buffer, each
        broadcast exactly as large as declared (a larger one kills that process, not this
        one); a shorter one leaves the last byte of its region as set before (`_UNFILLED`),
        refused here; then the tensors are copied into the staging views."""
        if load_format == FLATTENED_BUCKET:
            total = sum(m.nbytes for m in metas)
            regions = [(0, total, dtype_name(metas[0].dtype))]
            offsets, offset = [], 0
            for m in metas:
                offsets.append(offset)
                offset += m.nbytes
        else:
            offsets, offset = [], 0
            for m in metas:
                offsets.append(offset)
                offset += -(-m.nbytes // 64) * 64  # aligned for every dtype's view
            total = offset
            regions = [
                (o, m.nbytes, dtype_name(m.dtype)) for o, m in zip(offsets, metas, strict=True)
            ]
        buf = group.buffer(total)
        ends = [o + n - 1 for o, n, _ in regions if n > 0]
        buf[ends] = _UNFILLED
        group.receive(regions)
        short = [e for e in ends if int(buf[e]) == _UNFILLED]
        if short:
            bad = next(m for m, o in zip(metas, offsets, strict=True) if o <= short[0] < o + max(m.nbytes, 1)) \
                if load_format != FLATTENED_BUCKET else metas[-1]  # fmt: skip
            raise ValueError(
                f"{bad.name}: fewer bytes arrived than its {dtype_name(bad.dtype)} "
                f"{list(bad.shape)} declares (or its last value has the top byte 0xff: "
                "|x| >= 2**127, refused as the same); nothing of it is served")  # fmt: skip
        chunk_bytes = 0
        for m, o in zip(metas, offsets, strict=True):
            views[m.name].copy_(buf[o : o + m.nbytes].view(m.dtype).view(m.shape))
            chunk[m.name] = views[m.name]
            chunk_bytes += m.nbytes
            if chunk_bytes >= CHECK_CHUNK_BYTES:
                check()
                chunk_bytes = 0

    def receive_tensors(self, named: Mapping[str, torch.Tensor], version: int) -> ReceiveResult:
        """Colocated (CUDA IPC): tensors already rebuilt from their handles; applied at once."""
        self.engine.update_weights(version, dict(named))
        return ReceiveResult(version, True, len(named), len(self._expected_split))

    def _drop(self, group_name: str) -> None:
        with self._lock:
            group = self._groups.pop(group_name, None)
        if group is not None:
            group.close()

    def weights_by_name(self, name: str, truncate_size: int) -> list[Any]:
        """The parameter `name` (an HF name, split or fused experts) flattened, first
        `truncate_size` values (SGLang's /get_weights_by_name)."""
        from slipstream.model.checkpoint import hf_from_internal

        internal = {k: v.detach() for k, v in self.engine.model.state_dict().items()}
        cfg = self.engine.model.config
        split = hf_from_internal(internal, cfg, fused_experts=False)
        t = split.get(name)
        if t is None:
            t = hf_from_internal(internal, cfg, fused_experts=True).get(name)
        if t is None:
            raise ValueError(f"no parameter {name[:200]!r}")
        return t.reshape(-1)[:truncate_size].float().tolist()


# ---- trainer side ------------------------------------------------------------------------------


@dataclass
class SendReport:
    """One version's push: bytes, seconds until every member served it, per-engine seconds."""

    version: int
    bytes: int
    seconds: float
    served_s: dict[str, float] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    """Engines this push dropped (not those dropped before it)."""
    retried: bool = False


class TransferFailed(RuntimeError):
    """A push failed on every member, or after its one retry."""


class WeightSender(Protocol):
    """What the trainer's push (rl/weight_sync.py) needs of a sender: `DistributedSender` (a
    process-group broadcast) or `IpcSender` (CUDA IPC handles)."""

    dropped: list[str]

    def add_engine(self, url: str, api_key: str | None = None) -> None: ...

    def send(self, version: int, state: Mapping[str, torch.Tensor]) -> SendReport: ...

    def close(self) -> None: ...


class _Engines:
    """Membership and HTTP shared by the trainer-side senders: the engines pushed to, the ones
    dropped (caught up from the store and readmitted when they answer again), their API keys.
    `catch_up(url, headers)`: bring a (re)joining engine to the newest stored version (None: it
    joins with whatever it serves)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float,
        api_key: str | None,
        catch_up: Callable[[str, dict[str, str]], None] | None,
        probe_timeout_s: float,
    ) -> None:
        import httpx

        if len(urls) > MAX_ENGINES:
            raise ValueError(f"a weight sender pushes to at most {MAX_ENGINES} engines")
        self.members: list[str] = [u.rstrip("/") for u in urls]
        self.dropped: list[str] = []
        self.timeout_s, self.catch_up, self.probe_timeout_s = timeout_s, catch_up, probe_timeout_s
        self._keys: dict[str, str | None] = {u: api_key for u in self.members}
        self.success_field = True
        """SGLang answers {"success": bool, ...}; vLLM answers 200 {"message"} or an error."""
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s + 10.0))
        # one thread per member request in flight: every member's /init_weights_update_group
        # blocks until all joined, so fewer threads than members would deadlock the rendezvous
        # (threads are started on demand, up to this bound)
        self._pool = ThreadPoolExecutor(MAX_ENGINES, thread_name_prefix="wpush")

    def add_engine(self, url: str, api_key: str | None = None) -> None:
        """An engine joining mid-run: caught up from the store, pushed to from the next version."""
        if len(self.members) + len(self.dropped) >= MAX_ENGINES:
            raise ValueError(f"a weight sender pushes to at most {MAX_ENGINES} engines")
        self._keys[url.rstrip("/")] = api_key
        self.dropped.append(url.rstrip("/"))

    def _headers(self, url: str) -> dict[str, str]:
        key = self._keys.get(url)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _healthy(self, url: str) -> bool:
        import httpx

        try:
            resp = self._http.get(f"{url}/health", timeout=self.probe_timeout_s,
                                  headers=self._headers(url))  # fmt: skip
            return resp.status_code == 200
        except httpx.HTTPError:
            return False

    def _readmit(self) -> None:
        for url in list(self.dropped):
            if not self._healthy(url):
                continue
            try:
                if self.catch_up is not None:
                    self.catch_up(url, self._headers(url))
            except Exception as e:  # noqa: BLE001 - stays dropped; retried next version
                log.warning("engine %s: catching up from the store failed: %s", url, e)
                continue
            self.dropped.remove(url)
            self.members.append(url)
            log.info("engine %s rejoins at the next weight version", url)

    def _drop(self, url: str, why: str) -> None:
        if url in self.members:
            self.members.remove(url)
            self.dropped.append(url)
            log.warning("engine %s dropped from weight pushes (%s); it catches up from the store",
                        url, why)  # fmt: skip

    def _post(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = self._http.post(f"{url}{path}", json=body, headers=self._headers(url))
        out = (
            resp.json()
            if resp.headers.get("content-type", "").startswith("application/json")
            else {}
        )
        if resp.status_code != 200 or (self.success_field and not out.get("success", False)):
            why = out.get("message") or out.get("detail") or resp.text[:200]
            raise RuntimeError(f"{url}{path}: {resp.status_code} {why}")
        return out

    def _post_quiet(self, url: str, path: str, body: dict[str, Any]) -> None:
        import httpx

        try:
            self._http.post(f"{url}{path}", json=body, timeout=self.probe_timeout_s,
                            headers=self._headers(url))  # fmt: skip
        except httpx.HTTPError as e:
            log.debug("%s%s: %s", url, path, e)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()


class DistributedSender(_Engines):
    """Rank 0 of a distributed weight-update protocol: pushes every version to the engines at
    `urls` through their endpoints, one request per dtype-grouped bucket of at most
    `bucket_bytes`, its tensors broadcast one by one (`bucket_format` "per_tensor") or
    concatenated ("flattened_bucket").
    `api` "sglang": SGLang's endpoints (our `slipstream serve` or SGLang). `api` "vllm": vLLM's
    weight-transfer API (our `slipstream serve` or a vLLM server in dev mode): the group is
    formed by /init_weight_transfer_engine (rank offsets from each engine's /get_world_size),
    a version is /start_weight_update, one /update_weights per bucket (per tensor: vLLM's
    packed format is not spoken), /finish_weight_update with the version. With `backend`
    "nccl" the trainer's end is vLLM's own PyNccl group (`VllmNcclGroup`, needs the vllm
    package; never run here); "gloo" is a torch group only `slipstream serve` joins.
    `api_key`: the Bearer key of the engines at `urls` (`add_engine` takes one per engine);
    `catch_up`: see `_Engines`. See the module docstring for membership epochs and faults."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        bucket_bytes: int = 2**30,
        bucket_format: str = "per_tensor",
        timeout_s: float = 60.0,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        api_key: str | None = None,
        catch_up: Callable[[str, dict[str, str]], None] | None = None,
        probe_timeout_s: float = 2.0,
        api: str = "sglang",
    ) -> None:
        if bucket_format not in ("per_tensor", FLATTENED_BUCKET):
            raise ValueError(f"bucket_format {bucket_format!r} is not 'per_tensor' or "
                             f"{FLATTENED_BUCKET!r}")  # fmt: skip
        if api not in ("sglang", "vllm"):
            raise ValueError(f"api {api!r} is not 'sglang' or 'vllm'")
        if api == "vllm" and bucket_format != "per_tensor":
            raise ValueError("api 'vllm' sends one broadcast per tensor (vLLM's packed format "
                             "is not spoken): bucket_format must be 'per_tensor'")  # fmt: skip
        super().__init__(urls, timeout_s=timeout_s, api_key=api_key, catch_up=catch_up,
                         probe_timeout_s=probe_timeout_s)  # fmt: skip
        self.api = api
        self.success_field = api == "sglang"
        self.bucket_bytes, self.backend, self.master_address = bucket_bytes, backend, master_address
        self.flattened = bucket_format == FLATTENED_BUCKET
        self._group: WeightGroup | VllmNcclGroup | None = None
        self._group_members: list[str] = []
        self.epoch = 0
        self.groups_opened: list[str] = []
        """Every group name this sender opened, in order (one per membership epoch)."""

    def _close_group(self) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        group.close()
        if self.api == "vllm":  # vLLM has no destroy: its next init replaces the group
            return
        for url in self._group_members:  # best effort: a member may be gone
            if url in self.members:
                self._post_quiet(url, "/destroy_weights_update_group", {"group_name": group.name})

    def open_group(self) -> None:
        """Form the group of the current members now (else the next `send` does)."""
        self._ensure_group()

    def _ranks(self, url: str) -> int:
        """Ranks an engine takes in the group: 1, or vLLM's /get_world_size (TP x PP x DP)."""
        if self.api == "sglang":
            return 1
        resp = self._http.get(f"{url}/get_world_size", headers=self._headers(url),
                              timeout=self.probe_timeout_s + 10.0)  # fmt: skip
        resp.raise_for_status()
        return int(resp.json()["world_size"])

    def _init_request(self, port: int, rank_offset: int, world: int,
                      name: str) -> tuple[str, dict[str, Any]]:  # fmt: skip
        if self.api == "sglang":
            return "/init_weights_update_group", {
                "master_address": self.master_address, "master_port": port,
                "rank_offset": rank_offset, "world_size": world, "group_name": name,
                "backend": self.backend}  # fmt: skip
        info: dict[str, Any] = {"master_address": self.master_address, "master_port": port,
                                "rank_offset": rank_offset, "world_size": world}  # fmt: skip
        if self.backend == "gloo":  # our extension: vLLM has no gloo backend (and no such key)
            info["backend"] = "gloo"
        return "/init_weight_transfer_engine", {"init_info": info}

    def _ensure_group(self) -> WeightGroup | VllmNcclGroup | None:
        if self._group is not None and self._group_members == self.members:
            return self._group
        self._close_group()
        if not self.members:
            return None
        self.epoch += 1
        members = list(self.members)
        name, port = f"slipstream-weights-e{self.epoch}", free_port(self.master_address)
        offsets: dict[str, int] = {}
        world = 1
        for url in members:
            try:
                ranks = self._ranks(url)
            except Exception as e:  # noqa: BLE001 - an engine that cannot say is left out
                self._drop(url, f"GET /get_world_size failed: {e}")
                return self._ensure_group()
            offsets[url], world = world, world + ranks
        futures = {url: self._pool.submit(self._post, url, *self._init_request(
                       port, offsets[url], world, name)) for url in members}  # fmt: skip
        try:
            group: WeightGroup | VllmNcclGroup | None
            if self.api == "vllm" and self.backend == "nccl":  # pragma: no cover - CUDA + vllm
                group = VllmNcclGroup(name, self.master_address, port, world)
            else:  # the engine's end is named VLLM_GROUP under vLLM's protocol (it names none)
                group = WeightGroup(VLLM_GROUP if self.api == "vllm" else name, self.backend,
                                    self.master_address, port, 0, world, self.timeout_s)  # fmt: skip
        except RuntimeError as e:  # a member never joined (dead, or refused the group)
            group = None
            log.warning("weight group %s: not every engine joined: %s", name, e)
        errors = {u: e for u, f in futures.items() if (e := _error(f, self.timeout_s + 10.0))}
        self.groups_opened.append(name)
        if group is None or errors:
            if group is not None:
                group.close()
            for url in errors or [u for u in members if not self._healthy(u)]:
                self._drop(url, f"did not join group {name}: {errors.get(url, 'unhealthy')}")
            if set(members) == set(self.members):  # nobody identified: give up on this epoch
                raise TransferFailed(f"weight group {name}: could not be formed")
            return self._ensure_group()
        self._group, self._group_members = group, members
        return group

    # -- pushing --

    def send(self, version: int, state: Mapping[str, torch.Tensor]) -> SendReport:
        """Push `version` (HF-named tensors) to every member; returns once each member served it
        or was dropped. TransferFailed if nobody could be reached twice in a row."""
        self._readmit()
        metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in state.items()]
        buckets = plan_buckets(metas, self.bucket_bytes)
        total = sum(m.nbytes for m in metas)
        t0 = time.perf_counter()
        dropped_before = set(self.dropped)
        for attempt in range(2):
            group = self._ensure_group()
            if group is None:  # no member (left): nothing to push to
                new_drops = sorted(set(self.dropped) - dropped_before)
                return SendReport(version, total, 0.0, {}, new_drops, attempt > 0)
            try:
                served = self._push(group, version, state, buckets, t0)
            except _PushFailed as e:
                log.warning("weight version %d: push failed (%s); rebuilding the group", version, e)
                self._close_group()
                for url in list(self.members):
                    if url in e.failed or not self._healthy(url):
                        self._drop(url, str(e))
                continue
            new_drops = sorted(set(self.dropped) - dropped_before)
            return SendReport(version, total, time.perf_counter() - t0, served, new_drops,
                              attempt > 0)  # fmt: skip
        raise TransferFailed(f"weight version {version}: push failed twice")

    def _bucket_request(self, bucket: list[TensorMeta], group_name: str,
                        version: int) -> tuple[str, dict[str, Any]]:  # fmt: skip
        names = [m.name for m in bucket]
        dtypes = [dtype_name(m.dtype) for m in bucket]
        shapes = [list(m.shape) for m in bucket]
        if self.api == "vllm":
            return "/update_weights", {"update_info": {
                "names": names, "dtype_names": dtypes, "shapes": shapes, "packed": False}}  # fmt: skip
        return "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": False, "weight_version": str(version),
            "load_format": FLATTENED_BUCKET if self.flattened else None}  # fmt: skip

    def _all(self, members: list[str], path: str, body: dict[str, Any]) -> None:
        """One request to every member; _PushFailed naming the ones that failed."""
        futures = {u: self._pool.submit(self._post, u, path, body) for u in members}
        errors = {u: e for u, f in futures.items() if (e := _error(f, self.timeout_s + 10.0))}
        if errors:
            raise _PushFailed(f"{path} failed: {errors}", set(errors))

    def _push(self, group: WeightGroup | VllmNcclGroup, version: int,
              state: Mapping[str, torch.Tensor], buckets: list[list[TensorMeta]],
              t0: float) -> dict[str, float]:  # fmt: skip
        """One request per bucket: its tensors broadcast one by one straight from `state`, or
        flattened into one broadcast (the next bucket is flattened while one is on the wire).
        The next bucket's request goes out only after every member answered this one, so each
        engine takes the broadcasts in the order of its requests (a collective matches calls by
        order, and a small bucket can leave the sender before the engine took its request)."""
        members = list(self._group_members)
        served: dict[str, float] = {}

        def flat_of(bucket: list[TensorMeta]) -> torch.Tensor:
            return flatten([state[m.name] for m in bucket]).to(group.device)

        if self.api == "vllm":  # the version is named when it is finished
            self._all(members, "/start_weight_update", {})
        flat = flat_of(buckets[0]) if self.flattened else None
        for i, bucket in enumerate(buckets):
            path, body = self._bucket_request(bucket, group.name, version)
            futures = {u: self._pool.submit(self._post, u, path, body) for u in members}
            try:
                if flat is not None:
                    assert isinstance(group, WeightGroup)  # flattened: SGLang's protocol only
                    work = group.broadcast_async(flat)
                    if i + 1 < len(buckets):  # overlaps the transfer
                        flat = flat_of(buckets[i + 1])
                    group.wait(work)
                else:
                    for m in bucket:  # one at a time, as the receiver takes them
                        group.broadcast(state[m.name].detach().contiguous().to(group.device))
            except RuntimeError as e:
                failed = {u for u, f in futures.items() if f.done() and f.exception() is not None}
                group.close()  # unblocks the members still receiving
                raise _PushFailed(str(e), failed) from e
            errors: dict[str, str] = {}
            for u, f in futures.items():
                error = _error(f, self.timeout_s + 10.0)
                if error is None:
                    served[u] = time.perf_counter() - t0  # after its last bucket: serving
                else:
                    errors[u] = error
            if errors:
                raise _PushFailed(f"members did not receive a bucket: {errors}", set(errors))
        if self.api == "vllm":  # serving once the finish answered
            self._all(members, "/finish_weight_update", {"weight_version": str(version)})
            served = {u: time.perf_counter() - t0 for u in members}
        return served

    def close(self) -> None:
        self._close_group()
        super().close()


class VllmNcclGroup:  # pragma: no cover - CUDA and the vllm package (neither here)
    """The trainer's end of a vLLM server's NCCL weight-transfer group: vLLM's own
    StatelessProcessGroup + PyNcclCommunicator, formed by vLLM's
    `NCCLWeightTransferEngine.trainer_init` (the only wire vLLM's NCCL backend listens on; a
    torch process group does not rendezvous with it). Needs the vllm package in the trainer's
    environment, as TRL's vLLM client does. PyNccl has neither a timeout nor an abort: a member
    lost mid-broadcast leaves this broadcast (and the trainer) blocked, so the bounded-timeout
    guarantee of the torch groups does not hold on this wire (docs/weights.md). Never run: no
    GPU and no vllm here."""

    def __init__(self, name: str, master_address: str, master_port: int, world_size: int) -> None:
        try:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
        except ImportError as e:
            raise ValueError(
                "engine.api = 'vllm' over NCCL forms vLLM's own PyNccl group on the trainer, "
                "which needs the vllm package installed beside the trainer (pip install vllm); "
                "on CPU use gloo with slipstream serve"
            ) from e
        self.name = name
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._comm: Any = NCCLWeightTransferEngine.trainer_init({
            "master_address": master_address, "master_port": master_port,
            "world_size": world_size})  # fmt: skip

    def broadcast(self, tensor: torch.Tensor) -> None:
        self._comm.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        self._comm = None


class IpcSender(_Engines):
    """SGLang's `POST /update_weights_from_tensor` for engines on the trainer's own GPU
    (engine.weight_sync = "colocated"; NCCL refuses two ranks on one device): a version travels
    as CUDA IPC handles (`ipc_payload`), one payload for every member, and each engine copies the
    tensors device to device out of the trainer's memory before it answers; nothing crosses the
    host. The payload points at a snapshot of the version, not at `state`, kept until every
    member's request ended: an engine that stalls past `timeout_s` is dropped (caught up from the
    store when it answers again) and may still copy late, and it must copy this version, not
    the trainer's next one. The snapshot costs one copy of the weights on the GPU per push.
    CUDA only: never run (no GPU has been lent to this work; docs/gpu.md)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float = 60.0,
        api_key: str | None = None,
        catch_up: Callable[[str, dict[str, str]], None] | None = None,
        probe_timeout_s: float = 2.0,
    ) -> None:
        super().__init__(urls, timeout_s=timeout_s, api_key=api_key, catch_up=catch_up,
                         probe_timeout_s=probe_timeout_s)  # fmt: skip
        self._in_flight: dict[int, dict[str, torch.Tensor]] = {}  # version -> its snapshot

    def send(self, version: int, state: Mapping[str, torch.Tensor]) -> SendReport:
        """Push `version` (HF-named CUDA tensors) to every member; returns once each served it
        or was dropped. ValueError (nothing sent) for a tensor not on a CUDA device."""
        not_cuda = [n for n, t in state.items() if t.device.type != "cuda"]
        if not_cuda:
            raise ValueError(f"engine.weight_sync = 'colocated' sends CUDA IPC handles; "
                             f"{len(not_cuda)} tensors are not on a GPU, e.g. {not_cuda[:3]}")  # fmt: skip
        self._readmit()
        total = sum(t.numel() * t.element_size() for t in state.values())
        t0 = time.perf_counter()
        members = list(self.members)
        if not members:
            return SendReport(version, total, 0.0)
        snapshot = {n: t.detach().clone() for n, t in state.items()}
        torch.cuda.current_stream().synchronize()  # written before another process reads it
        body = {"serialized_named_tensors": [ipc_payload(snapshot)], "flush_cache": False,
                "weight_version": str(version)}  # fmt: skip
        self._in_flight[version] = snapshot
        futures = {u: self._pool.submit(self._post, u, "/update_weights_from_tensor", body)
                   for u in members}  # fmt: skip
        remaining = set(futures)

        def release(u: str) -> None:  # the snapshot lives until the last request ended
            remaining.discard(u)
            if not remaining:
                self._in_flight.pop(version, None)

        for u, f in futures.items():
            f.add_done_callback(lambda _f, u=u: release(u))
        served: dict[str, float] = {}
        dropped: list[str] = []
        for u, f in futures.items():
            error = _error(f, self.timeout_s + 10.0)
            if error is None:
                served[u] = time.perf_counter() - t0
            else:
                self._drop(u, error)
                dropped.append(u)
        return SendReport(version, total, time.perf_counter() - t0, served, dropped)


def ipc_payload(state: Mapping[str, torch.Tensor]) -> str:
    """One entry of SGLang's `serialized_named_tensors`: base64 of [(name, tensor)] pickled with
    torch.multiprocessing's reductions (a CUDA tensor pickles to an IPC handle of its storage
    plus its offset and shape; what SGLang's MultiprocessingSerializer writes)."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions with ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(state.items()))
    return base64.b64encode(buf.getvalue()).decode()


def store_catch_up(
    weights: Any, *, timeout_s: float = 600.0
) -> Callable[[str, dict[str, str]], None]:
    """A `DistributedSender.catch_up`: tell an engine to load the newest version of the weight
    store `weights` (a `PublishedWeights`) by location (SGLang's /update_weights_from_disk);
    nothing when the store holds none yet or the engine already serves it or a newer one."""
    import httpx

    def catch_up(url: str, headers: dict[str, str]) -> None:
        versions = weights.versions()
        if not versions:
            return
        served = httpx.get(f"{url}/get_model_info", headers=headers, timeout=timeout_s).json()
        version = str(served.get("weight_version", ""))
        if version.isdigit() and int(version) >= versions[-1]:
            return  # already at (or past) the newest stored version: nothing to load
        body = {"model_path": weights.location(versions[-1]), "weight_version": str(versions[-1])}
        resp = httpx.post(f"{url}/update_weights_from_disk", json=body, headers=headers,
                          timeout=timeout_s)  # fmt: skip
        if resp.status_code != 200 or not resp.json().get("success", False):
            raise RuntimeError(
                f"{url}/update_weights_from_disk: {resp.status_code} {resp.text[:300]}"
            )

    return catch_up


class _PushFailed(RuntimeError):
    def __init__(self, message: str, failed: set[str]) -> None:
        super().__init__(message)
        self.failed = failed


def _error(future: Future, timeout_s: float) -> str | None:
    """None when a member's request succeeded, else why not (named in the push's failure)."""
    try:
        future.result(timeout=timeout_s)
        return None
    except Exception as e:  # noqa: BLE001 - any failure of a member's request counts
        return f"{type(e).__name__}: {e}"[:300]
