"""The reward worker processes: users' reward code (and math-verify's sympy) runs here, never in
the rollout worker.

    pool = RewardPool(workers=4, memory_bytes=2 << 30)
    values = pool.call(spec, kwargs, n=8, timeout_s=10.0)   # list[float | None], or CallFailed
    pool.close()

Contract:
- Each process runs one call at a time, on its main thread (so math-verify's `signal.alarm`
  timeouts work there), under RLIMIT_AS = `memory_bytes` (an allocation past it is a
  MemoryError of that call). Processes are started with the "spawn" method: nothing of the
  rollout worker (its threads, torch, the engine) is inherited.
- `call` waits for a free process, sends the call, and waits at most `timeout_s` for the answer.
  A process that does not answer in time is killed (SIGKILL) and replaced; one that died (a
  crash, `os._exit`, the kernel's OOM killer) is replaced. Either way the call raises
  `CallFailed`: an error is never a reward.
- The answer must be a list (or, for a per-sample function, one value) of `n` entries, each an
  int or float (not bool) that is finite, or None: anything else raises `CallFailed` naming
  what came back (a string, NaN, the wrong length).
- `close()` kills every process. Thread-safe: the rollout worker's verify threads call it.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import multiprocessing as mp
import queue
import threading
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


class CallFailed(Exception):
    """One call of a reward function produced no usable reward (`kind`: "error", "timeout",
    "crash", "invalid")."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class FunctionSpec:
    """What a reward process calls: a kind and its parameters (picklable, hashable: the process
    caches the resolved callable by it)."""

    kind: str
    """"python", "math", "exact" or "regex"."""
    function: str = ""
    batched: bool = True
    pattern: str = ""
    answer_key: str = ""
    timeout_s: float = 10.0


def resolve(spec: FunctionSpec) -> Any:
    """The callable of a spec (in the reward process). ImportError / AttributeError name the
    module or attribute that is missing."""
    if spec.kind == "python":
        module, _, name = spec.function.partition(":")
        mod = importlib.import_module(module)
        try:
            return getattr(mod, name)
        except AttributeError:
            raise AttributeError(f"module {module!r} has no attribute {name!r}") from None
    from slipstream.rewards import builtin

    return builtin.make(spec)


def valid_values(out: Any, n: int, batched: bool) -> list[float | None]:
    """The call's answer as n rewards; CallFailed("invalid") naming what is wrong."""
    if not batched:
        out = [out]
    if not isinstance(out, list | tuple):
        raise CallFailed("invalid", f"returned {type(out).__name__} {_short(out)}, not a list")
    if len(out) != n:
        raise CallFailed("invalid", f"returned {len(out)} rewards for {n} completions")
    values: list[float | None] = []
    for v in out:
        if v is None:
            values.append(None)
            continue
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise CallFailed("invalid", f"returned {type(v).__name__} {_short(v)}, not a number")
        f = float(v)
        if not math.isfinite(f):
            raise CallFailed("invalid", f"returned {f}, not a finite number")
        values.append(f)
    return values


def _short(v: Any, limit: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _serve(conn: Any, memory_bytes: int) -> None:
    """A reward process: calls in, answers out, until the pipe closes."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    cache: dict[FunctionSpec, Any] = {}
    while True:
        try:
            spec, kwargs, n = conn.recv()
        except (EOFError, OSError):
            return
        try:
            fn = cache.get(spec)
            if fn is None:
                fn = cache[spec] = resolve(spec)
            if kwargs is None:  # `RewardPool.load`: resolve only
                conn.send(("ok", None))
                continue
            out = fn(**kwargs)
            if inspect.isawaitable(out):
                out = asyncio.run(_await(out))
            answer: tuple[str, Any] = ("ok", valid_values(out, n, spec.batched))
        except CallFailed as e:
            answer = (e.kind, str(e))
        except BaseException as e:  # noqa: BLE001 - user code: SystemExit, math-verify's TimeoutException too
            answer = ("error", f"{type(e).__name__}: {str(e)[:300]}")
        try:
            conn.send(answer)
        except (BrokenPipeError, OSError):
            return


async def _await(aw: Any) -> Any:
    return await aw


class _Proc:
    def __init__(self, ctx: Any, memory_bytes: int, index: int) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, memory_bytes), daemon=True,
                                   name=f"slipstream-reward-{index}")  # fmt: skip
        self.process.start()
        child.close()
        self._kill_lock = threading.Lock()
        self._killed = False

    def kill(self) -> None:
        """Idempotent and thread-safe: `close()` and the thread whose call the kill broke both
        come here, and a second `conn.close()` would close a descriptor number that may
        already belong to another file."""
        with self._kill_lock:
            if self._killed:
                return
            self._killed = True
            if self.process.is_alive():
                self.process.kill()
            self.process.join(5.0)
            self.conn.close()


class RewardPool:
    """`workers` reward processes (module docstring)."""

    def __init__(self, workers: int, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._closed = False
        self._started = 0
        self._idle: queue.SimpleQueue[_Proc] = queue.SimpleQueue()
        self._all: set[_Proc] = set()
        self.replaced = 0
        """Processes killed (timeout) or found dead (crash) and replaced."""
        for _ in range(workers):
            self._idle.put(self._spawn())

    def _spawn(self) -> _Proc:
        # spawn re-imports the parent's __main__ unless told not to; the reward process needs
        # only this module (and what the user's function imports)
        with self._lock:
            if self._closed:
                raise CallFailed("error", "the reward pool is closed")
            self._started += 1
            p = _Proc(self._ctx, self.memory_bytes, self._started)
            self._all.add(p)
        return p

    def _free(self) -> _Proc:
        """An idle process (waits for one); CallFailed once the pool is closed, so no caller
        waits forever for a process that will never come back."""
        while True:
            try:
                p = self._idle.get(timeout=0.2)
            except queue.Empty:
                if self._closed:
                    raise CallFailed("error", "the reward pool is closed") from None
                continue
            if self._closed:
                p.kill()
                raise CallFailed("error", "the reward pool is closed")
            return p

    def _replace(self, p: _Proc) -> None:
        p.kill()
        with self._lock:
            self._all.discard(p)
            self.replaced += 1
        try:
            self._idle.put(self._spawn())
        except CallFailed:
            pass  # closed meanwhile

    def call(self, spec: FunctionSpec, kwargs: dict[str, Any], n: int,
             timeout_s: float) -> list[float | None]:  # fmt: skip
        """Run spec's function on kwargs in a free process: n rewards, or CallFailed."""
        p = self._free()
        try:
            p.conn.send((spec, kwargs, n))
            if not p.conn.poll(timeout_s):
                self._replace(p)
                raise CallFailed("timeout", f"no answer within {timeout_s:g} s (process killed)")
            kind, value = p.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            code = p.process.exitcode
            p.process.join(1.0)
            code = p.process.exitcode if code is None else code
            self._replace(p)
            raise CallFailed("crash", f"the reward process died (exit code {code})") from None
        except CallFailed:
            raise
        except BaseException:
            self._replace(p)
            raise
        self._idle.put(p)
        if kind != "ok":
            raise CallFailed(kind, value)
        return valid_values(value, n, True)  # checked again here: the process is not trusted

    def load(self, spec: FunctionSpec, timeout_s: float = 300.0) -> None:
        """Import spec's function in a reward process (at start: an import error is found before
        the first completion); CallFailed naming the module or attribute otherwise."""
        p = self._free()
        try:
            p.conn.send((spec, None, 0))
            if not p.conn.poll(timeout_s):
                self._replace(p)
                raise CallFailed("timeout", f"importing took longer than {timeout_s:g} s")
            kind, value = p.conn.recv()
        except (EOFError, OSError):
            self._replace(p)
            raise CallFailed("crash", "the reward process died while importing") from None
        self._idle.put(p)
        if kind != "ok":
            raise CallFailed(kind, value)

    def pids(self) -> list[int]:
        with self._lock:
            return [p.process.pid for p in self._all if p.process.pid is not None]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            procs = list(self._all)
            self._all.clear()
        for p in procs:
            p.kill()
