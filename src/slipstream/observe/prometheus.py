"""Prometheus `/metrics` for the RL job and for `slipstream serve` (prometheus-client, the
`serve` extra).

The job (`run.metrics_port` > 0): `JobMetrics(port, host)` serves its own registry from a
daemon thread; the job driver feeds it the controller's per-step records (`on_record`, chained
with the live display) and lets it read the coordinator (`watch`). Nothing is added to the
training loop: every series is read from what the controller logs or the coordinator already
counts, at scrape time, plus one sampler thread that notes when the rollout backlog became
non-empty. Series (all prefixed `slipstream_`):

    from the step records   trainer_steps_total, trainer_samples_total, trainer_tokens_total,
                            samples_per_second (job mean), trainer_idle_ratio,
                            trainer_step_seconds / trainer_wait_seconds (last step),
                            policy_version, reward_mean, heldout_pass_at_1,
                            batch_staleness_mean / batch_staleness_max
    from the coordinator    queue_pending_tasks (redelivered, waiting), queue_leased_tasks,
                            queue_done_tasks, admission_slots, queue_leasable_tasks (what a
                            worker could lease now: the autoscaling queue depth),
                            rollout_demand_tasks (leased + leasable), queue_oldest_task_age_seconds
                            (how long the leasable backlog has been non-empty, sampled every
                            0.5 s: an upper bound on the age of the oldest queued task),
                            lease_expiries_total, redelivered_tasks_total, rejected_acks_total,
                            buffer_groups, buffer_dropped_stale_total, buffer_dropped_uniform_total,
                            buffer_wasted_samples_total, staleness (histogram of trained groups'
                            staleness), coordinator_version, coordinator_status{key} (any other
                            number status() reports)
    per rollout worker      worker_report_age_seconds, worker_stat{stat} (every number of its
                            report), worker_weight_version_lag (coordinator version - the
                            report's `weight_version`), worker_sandbox_pool{field} (the report's
                            `sandbox_pool_<field>` numbers): the last two only for workers whose
                            reports carry those keys; worker_weight_served_seconds and
                            worker_weight_served_version (engine.weight_sync = distributed: the
                            last version pushed to the worker's engine and the seconds from the
                            push's start until it served it).

`slipstream serve`: `ServeMetrics(engine)` plus its ASGI middleware count requests by endpoint
and status, requests in flight and their latency, and read the engine at scrape time (healthy,
weight version, running rows, slots, requests waiting for slots, decode/prefill token and
time counters).

Not covered: authentication of the job's endpoint (bind 127.0.0.1, the default, or a pod IP
on a private network), multiprocess collection (data-parallel ranks > 0 export nothing),
series of engines other than the native one (an HTTP-engine worker's server exports its own).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

log = logging.getLogger(__name__)
PREFIX = "slipstream_"
SAMPLE_PERIOD_S = 0.5


def _client() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core  # the metric families collectors yield
    except ImportError as e:
        raise ImportError(
            "Prometheus metrics need prometheus-client: pip install -e '.[serve]' (the `serve` "
            "extra)"
        ) from e
    return prometheus_client


class StatusView(Protocol):
    """What JobMetrics reads of a coordinator status (rl/coordinator.py's CoordinatorStatus;
    this layer may not import it)."""

    queue_pending_tasks: int
    queue_leased_tasks: int
    queue_done_tasks: int
    redelivered_tasks: int
    rejected_acks: int
    expired_leases: int
    buffered_groups: int
    dropped_stale_groups: int
    dropped_uniform_groups: int
    wasted_samples: int
    staleness_hist: dict[int, int]

    def other_numbers(self) -> dict[str, float]: ...


class CoordinatorView(Protocol):
    """What JobMetrics reads of the coordinator (rl/coordinator.py's Coordinator)."""

    worker_stats: dict[str, dict[str, float]]
    worker_seen_s: dict[str, float]
    weight_served: dict[str, dict[str, float]]

    def status(self) -> StatusView: ...

    def version(self) -> int: ...

    def stopping(self) -> bool: ...

    def rollout_backlog(self) -> dict[str, int | None]: ...


def leasable(backlog: dict[str, int | None], stopping: bool) -> int:
    """Tasks a worker could lease now: admission slots, bounded by the tasks there are."""
    if stopping:
        return 0
    slots = int(backlog["admission_slots"] or 0)
    unissued = backlog.get("unissued")
    available = None if unissued is None else int(backlog["pending"] or 0) + unissued
    return slots if available is None else min(slots, available)


class _JobCollector:
    def __init__(self, owner: JobMetrics) -> None:
        self.owner = owner

    def describe(self) -> list[Any]:
        return []  # collected at scrape time only

    def collect(self) -> Iterator[Any]:
        core = _client().core
        o = self.owner

        def gauge(name: str, doc: str, value: float | None) -> Any:
            if value is not None:
                return core.GaugeMetricFamily(PREFIX + name, doc, value=float(value))
            return None

        def counter(name: str, doc: str, value: float | None) -> Any:
            if value is not None:
                return core.CounterMetricFamily(PREFIX + name, doc, value=float(value))
            return None

        with o.lock:
            rec, totals = dict(o.last_record), dict(o.totals)
        fams = [
            counter("trainer_steps", "trainer steps taken", rec.get("step")),
            counter("trainer_samples", "samples trained", totals.get("samples")),
            counter("trainer_tokens", "sampled tokens trained", totals.get("tokens")),
            gauge("samples_per_second", "trained samples / RL loop time (job mean)",
                  rec.get("samples_per_s")),
            gauge("trainer_idle_ratio", "time the trainer waited for a batch / RL loop time",
                  rec.get("trainer_idle_frac")),
            gauge("trainer_step_seconds", "last step: train + publish", rec.get("train_s")),
            gauge("trainer_wait_seconds", "last step: wait for the batch", rec.get("idle_s")),
            gauge("policy_version", "the trainer's policy version", rec.get("version")),
            gauge("reward_mean", "last batch's mean reward", rec.get("reward_mean")),
            gauge("heldout_pass_at_1", "last held-out pass@1", o.pass_at_1),
            gauge("batch_staleness_mean", "last batch", rec.get("staleness_mean")),
            gauge("batch_staleness_max", "last batch", rec.get("staleness_max")),
        ]  # fmt: skip
        coord = o.coordinator
        if coord is not None:
            fams += list(self._coordinator(coord, gauge, counter, core))
        yield from (f for f in fams if f is not None)

    def _coordinator(self, coord: CoordinatorView, gauge: Callable, counter: Callable,
                     core: Any) -> Iterator[Any]:  # fmt: skip
        o = self.owner
        st = coord.status()
        backlog = coord.rollout_backlog()
        depth = leasable(backlog, coord.stopping())
        version = coord.version()
        yield gauge("coordinator_version", "policy version announced to workers", version)
        yield gauge("queue_pending_tasks", "redelivered tasks waiting", st.queue_pending_tasks)
        yield gauge("queue_leased_tasks", "tasks leased, not acked", st.queue_leased_tasks)
        yield gauge("queue_done_tasks", "tasks acked (or dropped)", st.queue_done_tasks)
        yield gauge("admission_slots", "more tasks admission control allows now",
                    backlog["admission_slots"])  # fmt: skip
        yield gauge("queue_leasable_tasks", "tasks a worker could lease now (queue depth)", depth)
        yield gauge("rollout_demand_tasks", "leased + leasable tasks (autoscaling signal)",
                    depth + st.queue_leased_tasks)  # fmt: skip
        yield gauge("queue_oldest_task_age_seconds", "how long the leasable backlog has been "
                    "non-empty (upper bound on the oldest queued task's age)", o.backlog_age_s())  # fmt: skip
        yield counter("lease_expiries", "leases that expired", st.expired_leases)
        yield counter("redelivered_tasks", "tasks handed out again", st.redelivered_tasks)
        yield counter("rejected_acks", "late or fenced acks", st.rejected_acks)
        yield gauge("buffer_groups", "groups waiting for the trainer", st.buffered_groups)
        yield counter("buffer_dropped_stale", "groups dropped as too stale",
                      st.dropped_stale_groups)  # fmt: skip
        yield counter("buffer_dropped_uniform", "groups dropped by dynamic sampling",
                      st.dropped_uniform_groups)  # fmt: skip
        yield counter("buffer_wasted_samples", "samples generated and never trained",
                      st.wasted_samples)  # fmt: skip
        hist = st.staleness_hist
        if hist:
            cum, buckets = 0, []
            for s in range(max(hist) + 1):
                cum += hist.get(s, 0)
                buckets.append((str(float(s)), cum))
            buckets.append(("+Inf", cum))
            yield core.HistogramMetricFamily(
                PREFIX + "staleness", "staleness (versions) of the groups trained", buckets=buckets,
                sum_value=float(sum(s * n for s, n in hist.items())))  # fmt: skip
        other = core.GaugeMetricFamily(PREFIX + "coordinator_status",
                                       "other numbers of Coordinator.status()", labels=["key"])  # fmt: skip
        for key, v in st.other_numbers().items():
            other.add_metric([key], float(v))
        yield other
        yield from self._workers(coord, version, core)

    def _workers(self, coord: CoordinatorView, version: int, core: Any) -> Iterator[Any]:
        now = time.time()
        stats, seen = dict(coord.worker_stats), dict(coord.worker_seen_s)
        age = core.GaugeMetricFamily(PREFIX + "worker_report_age_seconds",
                                     "seconds since the worker last leased or reported",
                                     labels=["worker"])  # fmt: skip
        stat = core.GaugeMetricFamily(PREFIX + "worker_stat", "the worker's last report",
                                      labels=["worker", "stat"])  # fmt: skip
        lag = core.GaugeMetricFamily(PREFIX + "worker_weight_version_lag",
                                     "coordinator version - the worker's engine version",
                                     labels=["worker"])  # fmt: skip
        pool = core.GaugeMetricFamily(PREFIX + "worker_sandbox_pool",
                                      "the worker's sandbox pool (in_use, idle, ...)",
                                      labels=["worker", "field"])  # fmt: skip
        for worker, t in seen.items():
            age.add_metric([worker], max(0.0, now - t))
        for worker, report in stats.items():
            for key, v in report.items():
                if not isinstance(v, int | float) or isinstance(v, bool):
                    continue
                stat.add_metric([worker, key], float(v))
                if key == "weight_version":
                    lag.add_metric([worker], float(version - v))
                elif key.startswith("sandbox_pool_"):
                    pool.add_metric([worker, key.removeprefix("sandbox_pool_")], float(v))
        served_s = core.GaugeMetricFamily(PREFIX + "worker_weight_served_seconds",
                                          "publish -> served seconds of the last pushed version",
                                          labels=["worker"])  # fmt: skip
        served_v = core.GaugeMetricFamily(PREFIX + "worker_weight_served_version",
                                          "the last version pushed to the worker's engine",
                                          labels=["worker"])  # fmt: skip
        for worker, served in dict(coord.weight_served).items():
            served_s.add_metric([worker], served["seconds"])
            served_v.add_metric([worker], served["version"])
        yield from (age, stat, lag, pool, served_s, served_v)


class JobMetrics:
    """/metrics of one RL job on host:port (see the module docstring). `close()` stops it."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        if not 0 < port < 65536:
            raise ValueError(f"metrics port {port} out of range 1-65535")
        client = _client()
        self.lock = threading.Lock()
        self.last_record: dict[str, Any] = {}
        self.totals: dict[str, float] = {"samples": 0.0, "tokens": 0.0}
        self.pass_at_1: float | None = None
        self.coordinator: CoordinatorView | None = None
        self._backlog_since: float | None = None
        self._stop = threading.Event()
        self.registry = client.CollectorRegistry()
        self.registry.register(_JobCollector(self))
        try:
            self._server, self._thread = client.start_http_server(port, addr=host,
                                                                  registry=self.registry)  # fmt: skip
        except OSError as e:
            raise OSError(f"run.metrics_port: cannot serve /metrics on {host}:{port}: {e}") from e
        self.url = f"http://{host}:{self._server.server_port}/metrics"
        self._sampler: threading.Thread | None = None

    def on_record(self, record: dict[str, Any]) -> None:
        """A controller record (rl/controller.py's per-step dict, or its start/end events)."""
        with self.lock:
            if record.get("pass_at_1") is not None:
                self.pass_at_1 = record["pass_at_1"]
            if record.get("event") is None and "step" in record:
                self.totals["samples"] += float(record.get("num_samples") or 0)
                self.totals["tokens"] += float(record.get("num_tokens") or 0)
                self.last_record = {k: v for k, v in record.items() if k != "task_ids"}

    def chain(self, other: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        """An on_record callback that feeds `other` and this exporter."""

        def both(record: dict[str, Any]) -> None:
            other(record)
            self.on_record(record)

        return both

    def watch(self, coordinator: CoordinatorView) -> None:
        """Read queue, buffer and worker series from `coordinator` from now on."""
        self.coordinator = coordinator
        if self._sampler is None:
            self._sampler = threading.Thread(target=self._sample, daemon=True,
                                             name="metrics-backlog")  # fmt: skip
            self._sampler.start()

    def backlog_age_s(self) -> float:
        since = self._backlog_since
        return 0.0 if since is None else time.monotonic() - since

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_PERIOD_S):
            coord = self.coordinator
            if coord is None:
                continue
            depth = leasable(coord.rollout_backlog(), coord.stopping())
            if depth <= 0:
                self._backlog_since = None
            elif self._backlog_since is None:
                self._backlog_since = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()


# ---- slipstream serve ----------------------------------------------------------------------


class EngineView(Protocol):
    """What ServeMetrics reads of the engine (engine/native.py's NativeEngine)."""

    stats: dict[str, float]
    batch: Any  # len() = running rows

    @property
    def healthy(self) -> bool: ...

    @property
    def version(self) -> int: ...

    @property
    def num_slots(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...


class ServeMetrics:
    """Request and engine series of one server. Without prometheus-client installed it logs a
    warning once and `/metrics` answers 503 saying what is missing (serving is unaffected)."""

    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, engine: EngineView, endpoints: frozenset[str] = frozenset()) -> None:
        """`endpoints`: paths counted by name; any other path counts as "other" (bounded
        label values whatever clients send)."""
        self.engine = engine
        self.endpoints = endpoints
        try:
            client = _client()
        except ImportError as e:
            log.warning("slipstream serve: /metrics disabled: %s", e)
            self.error: str | None = str(e)
            return
        self.error = None
        self.content_type = client.CONTENT_TYPE_LATEST
        self.registry = client.CollectorRegistry()
        self.requests = client.Counter(PREFIX + "serve_requests", "HTTP requests answered",
                                       ["endpoint", "code"], registry=self.registry)  # fmt: skip
        self.in_flight = client.Gauge(PREFIX + "serve_requests_in_flight", "HTTP requests open",
                                      ["endpoint"], registry=self.registry)  # fmt: skip
        self.latency = client.Histogram(PREFIX + "serve_request_seconds", "request latency",
                                        ["endpoint"], registry=self.registry)  # fmt: skip
        self.registry.register(_EngineCollector(engine))

    def endpoint(self, path: str) -> str:
        return path if path in self.endpoints else "other"

    def render(self) -> tuple[int, bytes]:
        """(status, body) of GET /metrics."""
        if self.error is not None:
            return 503, f"metrics unavailable: {self.error}\n".encode()
        return 200, _client().generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, engine: EngineView) -> None:
        self.engine = engine

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        core = _client().core
        e = self.engine
        s = dict(e.stats)
        yield core.GaugeMetricFamily(PREFIX + "engine_healthy", "1 while the engine can serve",
                                     value=1.0 if e.healthy else 0.0)  # fmt: skip
        yield core.GaugeMetricFamily(PREFIX + "engine_weight_version", "weights serving",
                                     value=float(e.version))  # fmt: skip
        yield core.GaugeMetricFamily(PREFIX + "engine_running_rows", "samples decoding now",
                                     value=float(len(e.batch)))  # fmt: skip
        yield core.GaugeMetricFamily(PREFIX + "engine_slots", "KV cache slots",
                                     value=float(e.num_slots))  # fmt: skip
        yield core.GaugeMetricFamily(PREFIX + "engine_waiting_requests",
                                     "requests waiting for KV cache slots",
                                     value=float(e.num_waiting))  # fmt: skip
        for key, name, doc in (
            ("decode_rows", "engine_decode_tokens", "tokens made by decode steps (each sample's "
             "first token comes from its prefill and is not counted)"),
            ("prefill_tokens", "engine_prefill_tokens", "prompt tokens prefilled"),
            ("decode_steps", "engine_decode_steps", "decode forwards"),
            ("forward_s", "engine_forward_seconds", "time inside model forwards"),
            ("step_s", "engine_step_seconds", "time inside engine steps"),
            ("prefix_cache_query_tokens", "engine_prefix_cache_query_tokens",
             "prompt tokens looked up in the prefix cache"),
            ("prefix_cache_hit_tokens", "engine_prefix_cache_hit_tokens",
             "prompt tokens served from the prefix cache (hit rate = hit / query)"),
        ):  # fmt: skip
            if key in s:
                yield core.CounterMetricFamily(PREFIX + name, doc, value=float(s[key]))


class RequestMetrics:
    """ASGI middleware: counts every HTTP request of the app into a ServeMetrics."""

    def __init__(self, app: Any, metrics: ServeMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        m = self.metrics
        if scope["type"] != "http" or m.error is not None:
            await self.app(scope, receive, send)
            return
        endpoint = m.endpoint(scope["path"])
        code = ["500"]  # an app that raises before responding

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                code[0] = str(message["status"])
            await send(message)

        t0 = time.perf_counter()
        m.in_flight.labels(endpoint).inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            m.in_flight.labels(endpoint).dec()
            m.requests.labels(endpoint, code[0]).inc()
            m.latency.labels(endpoint).observe(time.perf_counter() - t0)
