"""Byte meter: what each dispatch/combine call actually sent, split by link and by kind.

Every all-to-all a dispatcher issues reports its per-peer send sizes here (rows x bytes per row,
from the real split sizes, not from estimates). Links: "self" (a rank to itself: a local copy,
no wire), "intra" (another rank of the same node: NVLink on a cluster), "inter" (a rank on another
node: EFA/RDMA on a cluster). Kinds: "payload" (token activations) and "meta" (split counts,
expert ids, routing weights). Only sends are counted (each byte once, at its sender); only the
forward pass is metered - the backward of dispatch sends exactly the combine-direction sizes and
vice versa, so backward traffic equals the forward traffic of the opposite phase.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from slipstream.moe.rank_layout import Topology

LINKS = ("self", "intra", "inter")
KINDS = ("payload", "meta")


class ByteMeter:
    """Accumulates bytes and rows per (phase, link, kind) and the number of calls per phase."""

    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str, str], int] = defaultdict(int)
        self.rows: dict[tuple[str, str, str], int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def reset(self) -> None:
        self.bytes.clear()
        self.rows.clear()
        self.calls.clear()

    def start_call(self, phase: str) -> None:
        self.calls[phase] += 1

    def add(
        self,
        phase: str,
        kind: str,
        topo: Topology,
        src_rank: int,
        peer_ranks: Sequence[int],
        rows_per_peer: Sequence[int],
        row_bytes: int,
    ) -> None:
        """Record one all-to-all send: `rows_per_peer[i]` rows of `row_bytes` to `peer_ranks[i]`."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}; expected one of {KINDS}")
        if len(peer_ranks) != len(rows_per_peer):
            raise ValueError(f"{len(peer_ranks)} peers but {len(rows_per_peer)} split sizes")
        for peer, n in zip(peer_ranks, rows_per_peer, strict=True):
            link = topo.link(src_rank, peer)
            self.rows[(phase, link, kind)] += int(n)
            self.bytes[(phase, link, kind)] += int(n) * row_bytes

    def total(self, phase: str, link: str, kind: str | None = None) -> int:
        kinds = KINDS if kind is None else (kind,)
        return sum(self.bytes[(phase, link, k)] for k in kinds)

    def per_call(self, phase: str, link: str, kind: str | None = None) -> float:
        """Mean bytes per call of `phase` over `link` (all kinds unless `kind`)."""
        n = self.calls[phase]
        if n == 0:
            raise ValueError(f"no {phase!r} calls recorded")
        return self.total(phase, link, kind) / n

    def summary(self) -> dict[str, Any]:
        """{phase: {calls, link: {kind: bytes per call}}} for JSON reports."""
        out: dict[str, Any] = {}
        for phase, n in self.calls.items():
            d: dict[str, Any] = {"calls": n}
            for link in LINKS:
                d[link] = {k: self.bytes[(phase, link, k)] / n for k in KINDS}
            out[phase] = d
        return out
