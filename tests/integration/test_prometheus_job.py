"""Prometheus /metrics scraped from a running job and from `slipstream serve` while the job
rolls out through it (engine.type = http): the series move as the job runs."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobutil import TINY_MODEL, job_cmd, save_random_init, start_server
from s3util import free_port

Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Scrape | None:
    try:
        text = httpx.get(url, timeout=5).text
    except httpx.TransportError:  # not up yet, or already gone
        return None
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def series(scrapes: list[Scrape], name: str, **labels: str) -> list[float]:
    key = (f"slipstream_{name}", tuple(sorted(labels.items())))
    return [s[key] for s in scrapes if key in s]


def moved(values: list[float]) -> bool:
    """Never decreasing, and increased at least once."""
    return len(values) >= 2 and values == sorted(values) and values[-1] > values[0]


@pytest.mark.slow
def test_job_and_server_metrics_move_as_the_job_runs(tmp_path: Path) -> None:
    save_random_init(tmp_path / "init", TINY_MODEL)
    server, url = start_server(tmp_path, tmp_path / "init")
    port = free_port()
    cmd = job_cmd(tmp_path, tmp_path / "run", [
        *TINY_MODEL, "engine.type=http", f"engine.url={url}", "engine.server_wait_s=120",
        "trainer.steps=40", "trainer.groups_per_step=2", "rollout.group_size=2",
        "trainer.checkpoint_every=0", "trainer.eval_every=0", "trainer.skip_no_signal=false",
        f"run.metrics_port={port}",
    ])  # fmt: skip
    job_scrapes: list[Scrape] = []
    server_scrapes: list[Scrape] = []
    try:
        with open(tmp_path / "job.log", "wb") as log:
            job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 280
            while job.poll() is None and time.monotonic() < deadline:
                for target, out in ((f"http://127.0.0.1:{port}/metrics", job_scrapes),
                                    (f"{url}/metrics", server_scrapes)):  # fmt: skip
                    got = scrape(target)
                    if got is not None:
                        out.append(got)
                time.sleep(0.2)
            code = job.wait(timeout=30)
        assert code == 0, (tmp_path / "job.log").read_text()[-3000:]
        assert "metrics http://127.0.0.1" in (tmp_path / "job.log").read_text()
        # the job: steps, samples, versions and the staleness histogram grow as it trains
        for name in ("trainer_steps_total", "trainer_samples_total", "trainer_tokens_total",
                     "policy_version", "coordinator_version", "staleness_count",
                     "queue_done_tasks"):  # fmt: skip
            assert moved(series(job_scrapes, name)), (name, series(job_scrapes, name))
        idle = series(job_scrapes, "trainer_idle_ratio")
        assert idle and all(0 <= v <= 1 for v in idle)
        for name in ("queue_leasable_tasks", "rollout_demand_tasks", "admission_slots",
                     "queue_oldest_task_age_seconds", "lease_expiries_total",
                     "samples_per_second", "buffer_groups"):  # fmt: skip
            assert series(job_scrapes, name), name
        workers = {dict(k[1])["worker"] for s in job_scrapes for k in s
                   if k[0] == "slipstream_worker_stat"}  # fmt: skip
        assert workers, "no rollout worker report was exported"
        worker = sorted(workers)[0]
        assert moved(series(job_scrapes, "worker_stat", worker=worker, stat="samples"))
        # the server the worker rolls out through: requests, tokens and weight versions move
        assert moved(series(server_scrapes, "serve_requests_total", endpoint="/generate",
                            code="200"))  # fmt: skip
        assert moved(series(server_scrapes, "engine_decode_tokens_total"))
        assert moved(series(server_scrapes, "engine_weight_version"))
        assert set(series(server_scrapes, "engine_healthy")) == {1.0}
    finally:
        server.terminate()
        server.wait(timeout=30)
