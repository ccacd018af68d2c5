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


def unmet(job: list[Scrape], srv: list[Scrape]) -> list[str]:
    """What has not been seen yet: each series that must move, or exist, as the job runs."""
    out = []
    for name in ("trainer_steps_total", "trainer_samples_total", "trainer_tokens_total",
                 "policy_version", "coordinator_version", "staleness_count",
                 "queue_done_tasks"):  # fmt: skip
        if not moved(series(job, name)):
            out.append(f"{name} moved: {series(job, name)[-5:]}")
    idle = series(job, "trainer_idle_ratio")
    if not (idle and all(0 <= v <= 1 for v in idle)):
        out.append(f"trainer_idle_ratio in [0, 1]: {idle[-5:]}")
    for name in ("queue_leasable_tasks", "rollout_demand_tasks", "admission_slots",
                 "queue_oldest_task_age_seconds", "lease_expiries_total",
                 "samples_per_second", "buffer_groups"):  # fmt: skip
        if not series(job, name):
            out.append(f"{name} exported")
    workers = sorted({dict(k[1])["worker"] for s in job for k in s
                      if k[0] == "slipstream_worker_stat"})  # fmt: skip
    # a worker reports once a second: its samples move once two reports were scraped
    if not workers or not moved(series(job, "worker_stat", worker=workers[0], stat="samples")):
        out.append(f"a rollout worker's samples moved (workers {workers})")
    # the server the worker rolls out through: requests, tokens and weight versions move
    for name, labels in (("serve_requests_total", {"endpoint": "/generate", "code": "200"}),
                         ("engine_decode_tokens_total", {}), ("engine_weight_version", {})):  # fmt: skip
        if not moved(series(srv, name, **labels)):
            out.append(f"server {name} moved: {series(srv, name, **labels)[-5:]}")
    if set(series(srv, "engine_healthy")) != {1.0}:
        out.append(f"server engine_healthy always 1: {set(series(srv, 'engine_healthy'))}")
    return out


@pytest.mark.slow
def test_job_and_server_metrics_move_as_the_job_runs(tmp_path: Path) -> None:
    """Scrapes until every series has done what it must (not for a fixed number of steps: how
    many scrapes fit in a 40-step job depends on the machine's speed), then stops the job."""
    save_random_init(tmp_path / "init", TINY_MODEL)
    server, url = start_server(tmp_path, tmp_path / "init")
    port = free_port()
    cmd = job_cmd(tmp_path, tmp_path / "run", [
        *TINY_MODEL, "engine.type=http", f"engine.url={url}", "engine.server_wait_s=120",
        "trainer.steps=100000", "trainer.groups_per_step=2", "rollout.group_size=2",
        "trainer.checkpoint_every=0", "trainer.eval_every=0", "trainer.skip_no_signal=false",
        f"run.metrics_port={port}",
    ])  # fmt: skip
    job_scrapes: list[Scrape] = []
    server_scrapes: list[Scrape] = []
    try:
        with open(tmp_path / "job.log", "wb") as log:
            job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 280  # only a bound on a failing run
            while job.poll() is None and time.monotonic() < deadline:
                for target, out in ((f"http://127.0.0.1:{port}/metrics", job_scrapes),
                                    (f"{url}/metrics", server_scrapes)):  # fmt: skip
                    got = scrape(target)
                    if got is not None:
                        out.append(got)
                if not unmet(job_scrapes, server_scrapes):
                    break
                time.sleep(0.2)  # the scrape interval
            running = job.poll() is None
            if running:
                job.terminate()  # SIGTERM: the job unwinds (workers drained and stopped)
            code = job.wait(timeout=60)
        text = (tmp_path / "job.log").read_text()
        assert running, f"the job ended (rc {code}) before every series moved:\n{text[-3000:]}"
        assert code == 128 + 15 and "Traceback" not in text, text[-3000:]
        assert "metrics http://127.0.0.1" in text
        assert not unmet(job_scrapes, server_scrapes), unmet(job_scrapes, server_scrapes)
    finally:
        server.terminate()
        server.wait(timeout=30)
