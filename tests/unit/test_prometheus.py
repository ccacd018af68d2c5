"""observe/prometheus.py: the job's /metrics over real HTTP on loopback against a real
Coordinator (queue + buffer), and the server's request middleware and engine collector on a
small ASGI app with a stand-in engine. The running job and `slipstream serve` are scraped in
tests/integration/test_prometheus_job.py."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from s3util import free_port
from slipstream.observe.prometheus import JobMetrics, RequestMetrics, ServeMetrics, leasable
from slipstream.rl.buffer import ExperienceBuffer
from slipstream.rl.coordinator import Coordinator
from slipstream.rl.queue import TaskQueue
from slipstream.rl.types import Group, Sample


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(scraped: dict, name: str, **labels: str) -> float:
    return scraped[(f"slipstream_{name}", tuple(sorted(labels.items())))]


def group(task, version: int) -> Group:
    return Group(task=task, samples=[Sample([1], [2, 3], [-0.1, -0.2], [version, version],
                                            reward=float(i)) for i in range(2)])  # fmt: skip


def test_leasable_is_admission_bounded_by_the_tasks_there_are() -> None:
    endless = {"admission_slots": 6, "pending": 1, "in_flight": 2, "unissued": None}
    assert leasable(endless, stopping=False) == 6
    assert leasable({**endless, "unissued": 2}, stopping=False) == 3  # 1 pending + 2 fresh
    assert leasable(endless, stopping=True) == 0


def test_job_metrics_read_the_coordinator_and_the_records() -> None:
    coord = Coordinator(TaskQueue(100), ExperienceBuffer(groups_per_step=2, max_staleness=1))
    metrics = JobMetrics(free_port())
    try:
        metrics.watch(coord)
        lease = coord.lease("w0", 3, ttl_s=60)
        for task in lease.tasks[:2]:
            assert coord.ack(lease.lease_id, group(task, 0))
        assert coord.get_batch(2, timeout_s=1, version=1) is not None  # staleness 1 twice
        coord.set_version(1)
        coord.report("w0", {"samples": 4.0, "weight_version": 0, "sandbox_pool_in_use": 2,
                            "sandbox_pool_idle": 1, "note": "not a number"})  # fmt: skip
        coord.record_served(1, {"w0": 0.125})  # engine.weight_sync = distributed
        metrics.on_record({"event": "start", "pass_at_1": 0.25, "step": 0})
        metrics.on_record({"step": 1, "version": 1, "num_samples": 4.0, "num_tokens": 8.0,
                           "samples_per_s": 3.5, "trainer_idle_frac": 0.4, "train_s": 0.1,
                           "idle_s": 0.2, "reward_mean": 0.5, "staleness_mean": 1.0,
                           "staleness_max": 1, "task_ids": [0, 1]})  # fmt: skip
        s = samples(httpx.get(metrics.url, timeout=10).text)
        assert value(s, "trainer_steps_total") == 1 and value(s, "trainer_samples_total") == 4
        assert value(s, "trainer_tokens_total") == 8 and value(s, "trainer_idle_ratio") == 0.4
        assert value(s, "heldout_pass_at_1") == 0.25 and value(s, "policy_version") == 1
        assert value(s, "queue_leased_tasks") == 1 and value(s, "queue_done_tasks") == 2
        # admission at version 1, bound 1: (1 + 1 + 1) * 2 = 6 handed out at most; 2 consumed
        # + 1 in flight -> 3 more; the queue is endless, so 3 are leasable
        assert value(s, "admission_slots") == 3 and value(s, "queue_leasable_tasks") == 3
        assert value(s, "rollout_demand_tasks") == 4
        assert value(s, "staleness_bucket", le="1.0") == 2 and value(s, "staleness_count") == 2
        assert value(s, "staleness_sum") == 2
        assert value(s, "worker_stat", worker="w0", stat="samples") == 4
        assert value(s, "worker_weight_version_lag", worker="w0") == 1
        assert value(s, "worker_sandbox_pool", worker="w0", field="in_use") == 2
        assert value(s, "worker_report_age_seconds", worker="w0") >= 0
        assert value(s, "worker_weight_served_seconds", worker="w0") == 0.125
        assert value(s, "worker_weight_served_version", worker="w0") == 1
        assert value(s, "lease_expiries_total") == 0
        # the sampler notes when the backlog became non-empty: its age grows while it stays
        deadline = time.monotonic() + 30
        while value(s, "queue_oldest_task_age_seconds") <= 0:
            assert time.monotonic() < deadline, "backlog age never moved"
            time.sleep(0.2)
            s = samples(httpx.get(metrics.url, timeout=10).text)
        coord.request_stop()  # a stopping coordinator leases nothing: no backlog
        s = samples(httpx.get(metrics.url, timeout=10).text)
        assert value(s, "queue_leasable_tasks") == 0
    finally:
        metrics.close()


def test_a_busy_port_is_named() -> None:
    first = JobMetrics(free_port())
    try:
        port = int(first.url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(OSError, match=f"run.metrics_port.*{port}"):
            JobMetrics(port)
    finally:
        first.close()
    with pytest.raises(ValueError, match="70000"):
        JobMetrics(70000)


class FakeEngine:
    healthy, version, num_slots, num_waiting = True, 3, 8, 5
    stats = {"decode_rows": 40.0, "prefill_tokens": 12.0, "decode_steps": 10.0,
             "forward_s": 0.5, "step_s": 0.6}  # fmt: skip
    batch = [0, 1]  # two running rows


def test_serve_metrics_count_requests_and_read_the_engine() -> None:
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route
    from starlette.testclient import TestClient

    engine = FakeEngine()
    metrics = ServeMetrics(engine, endpoints=frozenset({"/generate", "/metrics"}))

    async def generate(request):  # noqa: ANN001, ANN202
        return PlainTextResponse("ok")

    async def render(request):  # noqa: ANN001, ANN202
        status, body = metrics.render()
        return Response(body, status_code=status, media_type=metrics.content_type)

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"]),
                            Route("/metrics", render)])  # fmt: skip
    app.add_middleware(RequestMetrics, metrics=metrics)
    with TestClient(app) as client:
        for _ in range(3):
            assert client.post("/generate").status_code == 200
        assert client.get("/no/such/path").status_code == 404
        s = samples(client.get("/metrics").text)
    assert value(s, "serve_requests_total", endpoint="/generate", code="200") == 3
    assert value(s, "serve_requests_total", endpoint="other", code="404") == 1
    assert value(s, "serve_request_seconds_count", endpoint="/generate") == 3
    assert value(s, "serve_requests_in_flight", endpoint="/metrics") == 1  # this scrape
    assert value(s, "engine_healthy") == 1 and value(s, "engine_weight_version") == 3
    assert value(s, "engine_running_rows") == 2 and value(s, "engine_slots") == 8
    assert value(s, "engine_waiting_requests") == 5
    assert value(s, "engine_decode_tokens_total") == 40
    assert value(s, "engine_prefill_tokens_total") == 12
