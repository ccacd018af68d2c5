"""`[engine]`: the rollout inference engine (native in-process, or HTTP to our server/SGLang/vLLM)."""

from typing import Literal

from pydantic import Field, model_validator

from slipstream.config.base import Section


class EngineConfig(Section):
    type: Literal["native", "http"] = "native"
    """`native`: slipstream's in-process engine. `http`: a server speaking SGLang's native API
    (`slipstream serve`, SGLang); in the RL job each rollout worker is then a client of it.
    With weight_sync = "store" each worker has the server load every weight version by
    location (see docs/rl.md, "HTTP engine"); with "distributed" the trainer pushes every
    version to the server through its weight-transfer endpoints (docs/weights.md)."""
    url: str | None = None
    """Base URL of the server when type = "http" (e.g. http://127.0.0.1:30000). With
    weight_sync = "distributed" the trainer pushes to this same URL: it must reach the server
    there too."""
    server_wait_s: float = Field(default=600.0, ge=0)
    """type = "http" in the RL job: how long a starting rollout worker waits for the server's
    /health (a server started beside it may still be loading its model) before it fails."""
    weights_stage_dir: str | None = None
    """type = "http" in the RL job: a local directory the server can read (e.g. a volume shared
    with an SGLang sidecar) into which each rollout worker copies every weight version from the
    store (into <dir>/w<slot>/v<version>) before telling the server to load it. Needed when the
    server cannot read the store itself (SGLang and an s3:// store). Unset: the server is given
    the store's location."""
    max_batch_size: int = Field(default=64, ge=1)
    """Most sequences decoded together."""
    kv_cache_tokens: int = Field(default=16384, ge=64)
    """KV-cache budget in tokens (all running sequences together); the scheduler admits within it."""
    max_new_tokens: int = Field(default=32, ge=1)
    """Default completion length cap."""
    max_seq_len: int = Field(default=0, ge=0)
    """Slot length in tokens (prompt + completion) for the native engine; 0 = the model's
    max_position_embeddings. The engine runs min(max_batch_size, kv_cache_tokens // max_seq_len)
    sequences at once."""
    prefix_cache_tokens: int = Field(default=0, ge=0, le=2**24)
    """Native engine: tokens of KV kept across requests (engine/prefix_cache.py), so a prompt
    that starts with a sequence computed before (a GRPO prompt sent again, a multi-turn history
    resent) prefills only its new suffix; 0 = off. Memory: this many tokens of K and V for every
    layer, beside kv_cache_tokens. Cleared on every weight update."""
    weight_update_policy: Literal["finish_old", "continue_new", "abort"] = "continue_new"
    """Requests in flight during update_weights: `finish_old` finishes them on the old weights
    (new requests wait), `continue_new` continues them on the new weights (their cached prefix
    stays from the old ones), `abort` ends them with finish_reason "abort"."""
    device: str = "cpu"
    """Torch device of the native engine's model and KV cache."""
    max_weight_source_bytes: int | None = Field(default=None, ge=1 << 20, le=1 << 41)
    """Native engine weight loads: most bytes read from a source (the files its shard index
    names, together), checked on the listing before any is copied or read; unset = 4 x the model's
    parameter bytes + 64 MiB (an fp32 checkpoint of a bf16 model fits). At most 2 TiB: every
    tensor is held in host memory before the swap."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Native engine: dtype of the weights and the KV cache (the model is converted in place at
    engine start); `auto` keeps the model's own dtype. `bfloat16` is what CUDA decode wants
    (half the bytes per step, and the graph-captured expert path needs it)."""
    cuda_graphs: bool = True
    """Native engine on CUDA: capture the decode step in CUDA graphs at bucketed batch sizes
    (1, 2, 4, ..., the slots), replayed per step (docs/engine.md). Needs dtype bfloat16 (else
    off, logged). Ignored on CPU, where the same step runs eagerly."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """HTTP client: timeout of one request."""
    max_concurrency: int = Field(default=64, ge=1)
    """HTTP client: most requests in flight at once."""
    max_retries: int = Field(default=3, ge=0)
    """HTTP client: retries on connection errors and 5xx (exponential backoff)."""
    weight_sync: Literal["store", "distributed", "colocated"] = "store"
    """How the trainer hands each policy version to the engines (docs/weights.md): `store`:
    every version written to the weight store, engines load it from there; `distributed`: the
    trainer broadcasts every version to every engine over a torch process group (gloo on CPU,
    NCCL on GPU; SGLang's /update_weights_from_distributed), the store receiving every
    `weight_store_every`-th version for resumes, new engines and failed transfers;
    `colocated`: CUDA IPC handles to an engine on the trainer's GPU
    (/update_weights_from_tensor), CUDA only."""
    api: Literal["sglang", "vllm"] = "sglang"
    """weight_sync = "distributed": the weight-transfer API the trainer drives the engines with.
    `sglang`: SGLang's /init_weights_update_group + /update_weights_from_distributed. `vllm`:
    vLLM's weight-transfer API (/init_weight_transfer_engine, /start_weight_update,
    /update_weights, /finish_weight_update; one broadcast per tensor). The job's own engines
    (`slipstream serve`) answer both; over NCCL a vLLM server needs vLLM's own PyNccl group on
    the trainer (the vllm package installed there; docs/weights.md)."""
    weight_bucket_bytes: int = Field(default=2**30, ge=2**20, le=2**32)
    """weight_sync = "distributed": most bytes of one update request (one dtype; a larger
    tensor travels alone). Every request is a round trip the push waits on; at `mid` on a
    2-vCPU Zen 3, 1 GiB took the push from 1.9-2.2 s to 1.8-1.9 s against the raw broadcast's
    1.1-1.3 s (docs/weights.md). "flattened_bucket" holds one bucket per side in memory."""
    weight_bucket_format: Literal["per_tensor", "flattened_bucket"] = "per_tensor"
    """weight_sync = "distributed": how a request's tensors travel. "per_tensor" (SGLang's
    default): one broadcast per tensor, sent from the trainer's tensors and received straight
    into the engine's staging, no copy on either side (the measured steps: docs/weights.md).
    "flattened_bucket" (SGLang's load_format): one broadcast of the request's tensors
    concatenated, which costs a copy on each side but one collective per request (fewer,
    larger NCCL calls)."""
    weight_store_every: int = Field(default=10, ge=1, le=100_000)
    """weight_sync = "distributed": the store receives every N-th version (and the first and
    last), the fallback of an engine that missed a broadcast."""
    weight_sync_master_address: str = Field(default="127.0.0.1", min_length=1, max_length=255)
    """weight_sync = "distributed": the trainer's address every engine connects to for a push
    group's rendezvous (SGLang's and vLLM's `master_address`; the trainer hosts it on a free
    port of this address). The default reaches engines on the trainer's host only (the job's
    own engines); an external fleet (engine.type = "http") on other hosts needs the trainer's
    address on their network."""
    weight_sync_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    """weight_sync = "distributed": bound on one collective (a bucket's broadcast, a group's
    rendezvous); an engine that has not received within it is dropped from the group and
    catches up from the store."""

    @model_validator(mode="after")
    def _http_needs_url(self) -> "EngineConfig":
        if self.type == "http" and not self.url:
            raise ValueError(
                "engine.type = 'http' needs engine.url, the server's base URL "
                "(e.g. http://127.0.0.1:30000)"
            )
        if self.type == "http" and self.weight_sync == "colocated":
            raise ValueError(
                "engine.weight_sync = 'colocated' with engine.type = 'http': CUDA IPC handles "
                "reach only an engine on the trainer's GPU, which an external server is not; "
                "use engine.weight_sync = 'distributed' (pushes to the server) or 'store'"
            )
        if self.api == "vllm" and self.weight_sync != "distributed":
            raise ValueError(
                f"engine.api = 'vllm' selects vLLM's weight-transfer API for pushes and needs "
                f"engine.weight_sync = 'distributed' (got {self.weight_sync!r}; vLLM's IPC "
                "backend is not spoken, use engine.api = 'sglang' for 'colocated')"
            )
        if self.api == "vllm" and self.weight_bucket_format != "per_tensor":
            raise ValueError(
                "engine.api = 'vllm' sends one broadcast per tensor (vLLM's packed format is "
                "not spoken): engine.weight_bucket_format must be 'per_tensor'"
            )
        if self.weight_sync == "colocated" and not self.device.startswith("cuda"):
            raise ValueError(
                "engine.weight_sync = 'colocated' passes CUDA IPC handles and needs "
                f"engine.device = 'cuda' (got {self.device!r}); use 'distributed' (gloo) on CPU"
            )
        return self
