"""Live display of an RL run (rich): step, reward, held-out pass@1, samples/s, staleness, queue
depth, trainer idle share. Fed one record per step by the controller (`update`).

On a non-terminal stdout (CI logs) rich's Live prints nothing until the end; `plain=True` prints
one line per step instead.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table


def _fmt(v: Any, spec: str = ".3f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


class RLProgress:
    def __init__(self, console: Console | None = None, *, plain: bool | None = None) -> None:
        self.console = console or Console()
        self.plain = (not self.console.is_terminal) if plain is None else plain
        self.state: dict[str, Any] = {}
        self._live: Live | None = None

    def __enter__(self) -> RLProgress:
        if not self.plain:
            self._live = Live(self._table(), console=self.console, refresh_per_second=4)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._table())
            self._live.__exit__(None, None, None)

    def _table(self) -> Table:
        s = self.state
        t = Table(
            title=f"slipstream RL ({s.get('mode', '')})", show_header=True, header_style="bold"
        )
        for col in ("step", "reward", "pass@1 (start -> now)", "samples/s", "staleness mean/max",
                    "queue pending/leased", "buffered", "trainer idle"):  # fmt: skip
            t.add_column(col, justify="right")
        before = s.get("pass_at_1_start")
        t.add_row(
            f"{s.get('step', 0)}/{s.get('steps', '?')}",
            _fmt(s.get("reward_mean")),
            f"{_fmt(before)} -> {_fmt(s.get('pass_at_1'))}",
            _fmt(s.get("samples_per_s"), ".1f"),
            f"{_fmt(s.get('staleness_mean'), '.2f')}/{_fmt(s.get('staleness_max'))}",
            f"{_fmt(s.get('queue_pending'))}/{_fmt(s.get('queue_leased'))}",
            _fmt(s.get("buffered")),
            _fmt(s.get("trainer_idle_frac"), ".0%"),
        )
        return t

    def update(self, record: dict[str, Any]) -> None:
        if record.get("event") == "start":
            self.state["pass_at_1_start"] = record.get("pass_at_1")
            self.state["steps"] = record.get("steps")
        self.state.update({k: v for k, v in record.items() if k != "task_ids"})
        if self._live is not None:
            self._live.update(self._table())
        elif self.plain and "reward_mean" in record and record.get("event") is None:
            s = self.state
            self.console.print(
                f"step {s['step']}/{s.get('steps')} reward {_fmt(s.get('reward_mean'))} "
                f"pass@1 {_fmt(s.get('pass_at_1'))} samples/s {_fmt(s.get('samples_per_s'), '.1f')} "
                f"staleness {_fmt(s.get('staleness_mean'), '.2f')}/{_fmt(s.get('staleness_max'))} "
                f"queue {_fmt(s.get('queue_pending'))}/{_fmt(s.get('queue_leased'))} "
                f"idle {_fmt(s.get('trainer_idle_frac'), '.0%')}",
                highlight=False,
                soft_wrap=True,
            )
