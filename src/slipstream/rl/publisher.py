"""Publishing policy versions from a background thread, so the trainer's next step overlaps the
serialisation, hashing and writing of the last one's weights.

    publisher = Publisher(weights, coordinator)
    publisher.submit(version, state, hf_config)   # returns once the previous publish finished
    publisher.flush()                             # every submitted version is published

Contract:
- Versions are published one at a time, in submit order; after a version's files and manifest
  are in the store, the coordinator is told (`set_version`): workers only ever see announced
  versions, which exist. `submit` blocks while the previous version is still being written
  (at most one in flight), so the coordinator lags the trainer by at most one version.
- `submit` copies the state into the publisher's one `SafetensorsBuffer` on the caller's
  thread, after the previous publish finished, and the thread writes that buffer as the file:
  the caller may change its tensors (the trainer's next step) as soon as `submit` returns, and
  no serialisation runs beside the next step (a per-step publish through
  `safetensors.torch.save` made the quickstart's trainer step 96-131 ms where it is 89-96 ms
  with the buffer and 78-96 ms with no publish at all; docs/performance.md). The buffer is made
  on the first submit and again only if the names, dtypes or shapes change.
- An error in the thread (e.g. the store refusing non-finite weights, a full disk) is raised
  by the next `submit` or `flush`, naming the version; nothing after it is published.
- `background=False` publishes on the caller's thread (deterministic tests, debugging).

Not covered: publishing several versions concurrently, skipping versions no worker needs.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from slipstream.storage import WeightStore
from slipstream.storage.safetensors_buffer import SafetensorsBuffer


class PublishFailed(RuntimeError):
    """A background publish failed; the message names the version and the cause."""


class Publisher:
    def __init__(self, weights: WeightStore, coordinator: Any, *, background: bool = True,
                 announce: bool = True) -> None:  # fmt: skip
        """`announce=False`: only write (rl/weight_sync.py announces after its push)."""
        self.weights, self.coord, self.background = weights, coordinator, background
        self.announce = announce
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._failed_version = -1
        self._buffer: SafetensorsBuffer | None = None
        self.publish_s = 0.0
        """Total wall time spent publishing (in the thread, or inline)."""
        self.wait_s = 0.0
        """Total time `submit`/`flush` waited for the previous publish."""
        self.served_s: dict[str, float] = {}
        """Publish -> served seconds per engine (rl/weight_sync.py): not measured here, every
        engine loads from the store on its own."""
        self.fused_experts = False
        """`submit` takes per-expert tensors: the store holds transformers checkpoints."""

    def submit(
        self, version: int, state: dict[str, torch.Tensor], hf_config: dict[str, Any]
    ) -> None:
        """Publish `version` (HF-named `state`, config.json `hf_config`) after the previous one;
        `state` is copied before this returns (see the module contract)."""
        self.flush()
        if self._buffer is None or not self._buffer.matches(state):
            self._buffer = SafetensorsBuffer.for_tensors(state)
        self._buffer.fill(state)
        if not self.background:
            self._publish(version, self._buffer, hf_config)
            self._raise()
            return
        self._thread = threading.Thread(target=self._publish,
                                        args=(version, self._buffer, hf_config),
                                        daemon=True, name=f"publish-v{version}")  # fmt: skip
        self._thread.start()

    def flush(self) -> None:
        """Wait until every submitted version is published (raises PublishFailed if one failed)."""
        if self._thread is not None:
            t0 = time.perf_counter()
            self._thread.join()
            self.wait_s += time.perf_counter() - t0
            self._thread = None
        self._raise()

    def idle(self) -> None:
        """Nothing: every version is in the store, where a joining engine finds it."""

    def close(self) -> None:
        """`flush` (the `WeightSync` protocol's close: nothing else to release)."""
        self.flush()

    def _publish(self, version: int, state: SafetensorsBuffer, hf_config: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        try:
            self.weights.publish(version, state, hf_config)
            if self.announce:
                self.coord.set_version(version)
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's thread by _raise
            self._error, self._failed_version = e, version
        finally:
            self.publish_s += time.perf_counter() - t0

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise PublishFailed(f"publishing weight version {self._failed_version} failed: "
                                f"{type(err).__name__}: {err}") from err  # fmt: skip
