"""FIFO multi-server pool: the verifier's sandboxes or verification threads.

Jobs are offered in non-decreasing arrival time (the simulator's event order), so assigning
each to the server that frees first is exactly first-come-first-served with c servers (the
G/G/c recursion): start = max(arrival, earliest free time), end = start + service. No events are
needed per job; the caller schedules one event when a group's last job ends.

Not covered: priorities, preemption, servers that fail.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class ServerPool:
    """`num_servers` identical servers, FIFO. `busy_s` accumulates service time (utilisation)."""

    def __init__(self, num_servers: int) -> None:
        if num_servers < 1:
            raise ValueError(f"a pool needs at least one server, got {num_servers}")
        self.num_servers = num_servers
        self._free_s: list[float] = [0.0] * num_servers
        self.busy_s = 0.0
        self.wait_s = 0.0
        self.num_jobs = 0
        self._last_arrival_s = 0.0

    def submit(self, arrival_s: float, service_s: Iterable[float]) -> float:
        """Serve jobs arriving together at `arrival_s`; returns when the last of them ends."""
        if arrival_s < self._last_arrival_s - 1e-9:
            raise ValueError(
                f"arrivals must not go back in time: {arrival_s} after {self._last_arrival_s}"
            )
        self._last_arrival_s = arrival_s
        last_end = arrival_s
        for s in service_s:
            free = heapq.heappop(self._free_s)
            start = free if free > arrival_s else arrival_s
            end = start + s
            heapq.heappush(self._free_s, end)
            self.busy_s += s
            self.wait_s += start - arrival_s
            self.num_jobs += 1
            if end > last_end:
                last_end = end
        return last_end
