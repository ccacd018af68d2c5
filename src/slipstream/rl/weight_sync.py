"""The trainer's side of the weight-transport seam: how each policy version reaches the rollout
engines, chosen by `engine.weight_sync` (docs/weights.md). One Protocol, one factory:

    sync = make_weight_sync(cfg, weights, coordinator)
    sync.submit(version, hf_state, hf_config)   # the version reaches the engines (or is on its way)
    sync.flush()                                # every submitted version is where it goes
    sync.close()

- `store`: `Publisher` (rl/publisher.py): every version written to the weight store in the
  background, then announced; every engine loads it from there (today's path).
- `distributed`: every version broadcast to every registered engine (`Coordinator.engines()`:
  each rollout worker's native engine serves SGLang's weight endpoints and registers its URL;
  with `engine.type = "http"` each worker registers the external server it generates on,
  `engine.url`, and a server several workers share is one member of the pushes) over a
  torch process group (engine/weight_transport.py `DistributedSender`, through SGLang's
  endpoints or, with `engine.api = "vllm"`, vLLM's weight-transfer API), then announced; the
  store receives the first version and every `engine.weight_store_every`-th (synchronously,
  before the push: the fallback exists before anyone needs it), every version a push could not
  deliver to some engine (it catches up with exactly that version) or that reached none (no
  engine registered, or TransferFailed: the store carries it), the last one pushed when an
  engine registers while the trainer waits (`idle`), and, on `flush`, the last one pushed. An engine that missed a version (dropped after `engine.weight_sync_timeout_s`) loads
  the newest stored one and rejoins at the next push (an external server that cannot read the
  store, `engine.weights_stage_dir`, is caught up by its workers from their staged copies and
  rejoins at the next push). Native engines are handed the model's stacked expert tensors;
  an external server gets the checkpoint's per-expert names, what SGLang's and vLLM's loaders
  map. The publish -> served seconds of each worker's engine go to `Coordinator.record_served`
  (metrics and /metrics).
- `colocated`: the same pushes and store copies, the tensors sent as CUDA IPC handles to
  engines on the trainer's GPU (engine/weight_transport.py `IpcSender`, SGLang's
  /update_weights_from_tensor): refused on a machine without CUDA (the config already refuses
  engine.device != cuda); never run (no GPU has been lent to this work, docs/gpu.md).

Contract of `flush` under `distributed`: it stores the last pushed version from the tensors
handed to `submit`, which must still hold that version (the controller flushes right after a
publish, before the next step changes them).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from slipstream.config import SlipstreamConfig
from slipstream.engine.weight_transport import (
    DistributedSender,
    IpcSender,
    SendReport,
    TransferFailed,
    WeightSender,
    store_catch_up,
)
from slipstream.rl.publisher import Publisher
from slipstream.storage import WeightStore, check_finite

log = logging.getLogger(__name__)


class WeightSync(Protocol):
    """Trainer side of the weight transport (see the module docstring)."""

    publish_s: float
    """Total wall time spent handing versions over (store writes and pushes)."""
    served_s: dict[str, float]
    """Per engine (worker id): seconds from the last version's submit until it served it
    ({} where not measured)."""
    fused_experts: bool
    """The expert layout `submit` takes (`model.checkpoint.hf_from_internal`): False = one HF
    tensor per expert and projection (a transformers checkpoint, what the store holds); True =
    the model's own stacked expert tensors, which a push hands to our engines as they are (no
    per-expert copy on either side)."""

    def submit(
        self, version: int, state: dict[str, torch.Tensor], hf_config: dict[str, Any]
    ) -> None:
        """Hand `version` (HF-named tensors, config.json) over; announce it once engines can
        get it. The caller may change `state` once this returns (store: copied; distributed:
        pushed) except for `flush`'s contract."""
        ...

    def flush(self) -> None:
        """Every submitted version is where it goes (raises if one failed)."""
        ...

    def idle(self) -> None:
        """Called while the trainer waits for a batch (its tensors still hold the last
        submitted version): engines that registered since the last push get that version
        (store: nothing to do; a push: it is stored for them to load)."""
        ...

    def close(self) -> None: ...


def make_weight_sync(cfg: SlipstreamConfig, weights: WeightStore, coordinator: Any) -> WeightSync:
    """The `engine.weight_sync` plug-in of the trainer side."""
    mode = cfg.engine.weight_sync
    if mode == "store":
        return Publisher(weights, coordinator, background=cfg.trainer.background_publish)
    ec = cfg.engine
    # A server that cannot read the store (engine.weights_stage_dir: its rollout workers stage
    # each version for it) is not told a store location: it rejoins at the next push, and its
    # workers catch it up through their staged copies meanwhile (rl/worker.py sync_weights).
    external_staged = ec.type == "http" and ec.weights_stage_dir is not None
    catch_up = None if external_staged else store_catch_up(weights)
    timeout_s = ec.weight_sync_timeout_s
    if mode == "distributed":
        backend = "nccl" if ec.device.startswith("cuda") else "gloo"
        sender: WeightSender = DistributedSender(
            [], bucket_bytes=ec.weight_bucket_bytes, bucket_format=ec.weight_bucket_format,
            timeout_s=timeout_s, backend=backend, master_address=ec.weight_sync_master_address,
            catch_up=catch_up, api=ec.api)  # fmt: skip
        return PushWeightSync(cfg, weights, coordinator, sender)
    if not torch.cuda.is_available():
        raise ValueError("engine.weight_sync = 'colocated' passes CUDA IPC handles and needs a "
                         "GPU; this machine has none (use 'distributed' or 'store')")  # fmt: skip
    sender = IpcSender([], timeout_s=timeout_s, catch_up=catch_up)  # pragma: no cover - CUDA
    return PushWeightSync(cfg, weights, coordinator, sender)  # pragma: no cover - CUDA


class PushWeightSync:
    """`distributed` and `colocated`: push every version with `sender` (a process-group
    broadcast or CUDA IPC handles), store every N-th (see the module docstring)."""

    def __init__(self, cfg: SlipstreamConfig, weights: WeightStore, coordinator: Any,
                 sender: WeightSender) -> None:  # fmt: skip
        ec = cfg.engine
        self.coord, self.every = coordinator, ec.weight_store_every
        # the store copy is written before the push and announced by the push: never
        # announce a version before the engines serve it (the workers would load it too)
        self.store = Publisher(weights, coordinator, background=False, announce=False)
        self.sender = sender
        # the job's own engines take the stacked experts as they are (the store copy is split
        # into per-expert views); an external server (engine.type = http: SGLang, vLLM) is
        # pushed the checkpoint's per-expert names, which is what its loader maps
        self.fused_experts = ec.type == "native"
        self._model_config = cfg.model
        self._known: set[str] = set()  # engine URLs handed to the sender
        self._stored = -1
        self._last: tuple[int, dict[str, torch.Tensor], dict[str, Any]] | None = None
        self.publish_s = 0.0
        self.served_s: dict[str, float] = {}

    def submit(
        self, version: int, state: dict[str, torch.Tensor], hf_config: dict[str, Any]
    ) -> None:
        import time

        t0 = time.perf_counter()
        # as the store refuses them: a diverged trainer fails here, before any engine serves it
        check_finite(state, f"refusing to push weights version {version}")
        if self._stored < 0 or version % self.every == 0:
            self._store(version, state, hf_config)
        engines = self.coord.engines()
        for url, key in engines.values():
            if url not in self._known:  # workers sharing a server register its URL each
                self._known.add(url)
                self.sender.add_engine(url, key)  # caught up from the store, then in the group
        try:
            report = self.sender.send(version, state)
        except TransferFailed as e:  # nobody took it: the store carries this version
            log.warning("weight version %d: %s; storing it for the engines to load", version, e)
            report = SendReport(version, 0, 0.0, dropped=list(self.sender.dropped))
        if (report.dropped or not report.served_s) and self._stored != version:
            # an engine missed this version, or none took it (none registered yet: a resumed
            # trainer pushes from its restored buffer before the new workers' engines exist):
            # whoever joins later catches up with exactly it from the store
            self._store(version, state, hf_config)
        self._last = (version, state, hf_config)
        self.coord.set_version(version)
        # per worker: the seconds until the engine it generates on served the version
        self.served_s = {w: report.served_s[u] for w, (u, _) in engines.items()
                         if u in report.served_s}  # fmt: skip
        self.coord.record_served(version, self.served_s)
        self.publish_s += time.perf_counter() - t0

    def _store(
        self, version: int, state: dict[str, torch.Tensor], hf_config: dict[str, Any]
    ) -> None:
        from slipstream.model.checkpoint import hf_from_internal

        if self.fused_experts:  # views of the stacked tensors under per-expert names
            state = hf_from_internal(state, self._model_config, fused_experts=False)
        self.store.submit(version, state, hf_config)  # a transformers checkpoint
        self._stored = version

    def flush(self) -> None:
        if self._last is not None and self._last[0] != self._stored:
            self._store(*self._last)

    def idle(self) -> None:
        """An engine that registered after the last push would wait for the next one, which,
        when its worker is the one the trainer waits on, never comes: store the last version
        for it (the trainer is between steps, so `_last`'s tensors still hold it), and add it
        to the pushes (caught up from the store first)."""
        new = {u: k for u, k in self.coord.engines().values() if u not in self._known}
        if not new or self._last is None:
            return
        if self._last[0] != self._stored:
            log.info("weight version %d: storing it for %d engine(s) that joined after its "
                     "push", self._last[0], len(new))  # fmt: skip
            self._store(*self._last)
        for url, key in new.items():
            self._known.add(url)
            self.sender.add_engine(url, key)

    def close(self) -> None:
        self.sender.close()
