"""Shared pytest setup: keep torch to one thread per test process so that the suite behaves the same
on a 2-core CI machine and a workstation; the `moto` fixture (a real S3-compatible server)."""

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture
def moto() -> Iterator[int]:
    """Port of a fresh moto S3 server on 127.0.0.1 (no buckets), killed after the test."""
    from s3util import free_port, start_moto

    port = free_port()
    proc = start_moto(port)
    yield port
    proc.kill()
    proc.wait()
