"""Shared pytest setup: keep torch to one thread per test process so that the suite behaves the same
on a 2-core CI machine and a workstation."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
