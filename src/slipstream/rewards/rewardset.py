"""RewardSet: the one reward mechanism. `[[reward.functions]]` as the rollout worker's Verifier:
the reward of a completion is the weighted sum of its components' scores.

    rs = RewardSet(cfg.reward, local={"verifier": verifier.verify, "reward_model": rm_scorer},
                   sandboxes=verifier.sandboxes, closers=[verifier.close])
    score = rs.verify(task, completion)      # Score(reward, reason, components): per-sample
    scores = rs.score_group(task, texts)     # group functions, once the group finished
    rs.check(task, completion)               # `slipstream task check`: per-function results

Components:
- in-process (`local`): "verifier" (the task's own, the code task's sandboxed tests included)
  and "reward_model" (rm/source.py). Their InfraError propagates as before (the episode is
  re-run; a reward-model outage requeues the task).
- in the reward processes (`RewardPool`): "math", "exact", "regex", "python". A call that
  fails (CallFailed) is retried `reward.retries` times; then the sample's group is dropped
  (`RewardDropped`, counted per function) and never rewarded. The first failure of each kind of
  each function is logged once with an example completion. A function whose calls fail
  `reward.max_consecutive_failures` times in a row raises `RewardDropped(fatal=...)`: the
  worker stops the job with that one-line message naming the function.

What a user function receives (TRL's signature): `prompts` (the task's original prompt,
`meta["prompt"]`: a string, or a list of chat messages), `completions` (strings for string
prompts; `[{"role": "assistant", "content": text}]` per completion for message prompts, as TRL
passes them) and every column as a keyword argument holding a list (`meta["columns"]`; a
built-in task, which has no columns, passes its problem data `meta` with `answer` = its
reference answer). An agent episode (envs/agent.py) also passes `messages` (its final
conversation: the last chat call's messages plus the reply, OpenAI-style dicts; None when its
last call was a /v1/completions call) and `agent_output` (the agent's parsed result file or
stdout JSON; None when there is none); a group call of agent episodes lists each episode's,
in the group's order (`group_reward_inputs`); other tasks pass neither. A task column of either
name is a ValueError. A per-sample call is a list of 1 (`batched =
false`: the values themselves); a group call (`group = true`) lists the group's G completions.

Per-function counters (`reward_stats()`): calls, failed calls, dropped samples / groups, scores,
their sum and the share of None; the worker reports them (`reward_<name>_<counter>`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slipstream.config.rm import POOL_KINDS, RewardConfig, RewardFunctionConfig
from slipstream.envs.agent_trajectory import REWARD_INPUTS_KEY
from slipstream.envs.base import RewardDropped, Score
from slipstream.rewards.pool import CallFailed, FunctionSpec, RewardPool
from slipstream.tasks import Task

if TYPE_CHECKING:
    from slipstream.envs.sandboxes import SandboxHost

log = logging.getLogger(__name__)
LocalScorer = Callable[[Task, str], tuple[float, str]]


def reward_inputs(task: Task) -> tuple[Any, dict[str, Any]]:
    """(prompt, columns) a reward function sees for this task (module docstring); an agent
    episode's extra inputs (`REWARD_INPUTS_KEY`) among the columns."""
    prompt, columns, episode = _split_inputs(task)
    return prompt, {**columns, **episode}


def group_reward_inputs(task: Task, n: int) -> tuple[Any, dict[str, Any], dict[str, list[Any]]]:
    """(prompt, columns, per-completion inputs) a group function sees for this task and `n`
    completions: a group of agent episodes carries each extra input under `REWARD_INPUTS_KEY`
    as a list, one entry per completion in order (envs/episode.py `_group_task`); ValueError
    naming the input when one is not a list of `n`."""
    prompt, columns, episode = _split_inputs(task)
    for name, values in episode.items():
        if not isinstance(values, list) or len(values) != n:
            raise ValueError(f"task {task.task_id}: the agent episodes' reward argument {name!r} "
                             f"is not a list of the group's {n} completions")  # fmt: skip
    return prompt, columns, episode


def _split_inputs(task: Task) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(prompt, columns, an agent episode's extra inputs) of this task."""
    meta = task.meta
    prompt = meta.get("prompt", task.prompt)
    columns = meta.get("columns")
    if columns is None:  # a built-in task: its problem data, the answer under "answer"
        columns = {k: v for k, v in meta.items() if k not in ("prompt", REWARD_INPUTS_KEY)}
        columns.setdefault("answer", None)
    columns = dict(columns)
    episode = meta.get(REWARD_INPUTS_KEY, {})  # an agent episode's messages and agent_output
    clash = sorted(set(episode) & set(columns))
    if clash:  # a column would silently hide the episode's value (or the reverse)
        raise ValueError(f"task {task.task_id}: column(s) {clash} clash with the agent "
                         "episode's reward arguments of that name; rename the column(s)")  # fmt: skip
    return prompt, columns, dict(episode)


def as_completion(prompt: Any, text: str) -> Any:
    """A completion as TRL passes it: the text for a string prompt; one assistant message for a
    conversational (message-list) prompt."""
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


@dataclass
class FunctionStats:
    calls: int = 0
    failed_calls: int = 0
    consecutive_failures: int = 0
    dropped: int = 0
    scores: int = 0
    none: int = 0
    total: float = 0.0
    logged: set[str] = field(default_factory=set)


class RewardSet:
    """The worker's Verifier over `[[reward.functions]]` (module docstring)."""

    def __init__(self, cfg: RewardConfig, local: dict[str, LocalScorer] | None = None, *,
                 sandboxes: SandboxHost | None = None,
                 closers: Sequence[Callable[[], None]] = (),
                 pool: RewardPool | None = None) -> None:  # fmt: skip
        """`local`: the in-process scorers by kind ("verifier", "reward_model"); a function of
        such a kind without one is a ValueError. `pool`: the reward processes (default: started
        here when a function needs them, `reward.workers` of them)."""
        local = local or {}
        for f in cfg.functions:
            if f.kind not in POOL_KINDS and f.kind not in local:
                raise ValueError(f"reward function {f.name!r}: no {f.kind!r} scorer here")
        self.cfg = cfg
        self.local = local
        self.sandboxes = sandboxes
        self._closers = list(closers)
        gated = [f for f in cfg.functions if f.gate]
        self.sample_fns = [f for f in cfg.functions if not f.group and not f.gate] + gated
        self.group_fns = [f for f in cfg.functions if f.group]
        needs_pool = any(f.kind in POOL_KINDS for f in cfg.functions)
        self._own_pool = pool is None and needs_pool
        self.pool = pool if pool is not None or not needs_pool else RewardPool(
            cfg.workers, cfg.memory_bytes)  # fmt: skip
        self._stats = {f.name: FunctionStats() for f in cfg.functions}
        self._lock = threading.Lock()
        for f in cfg.functions:
            if f.kind in POOL_KINDS:
                assert self.pool is not None
                try:
                    self.pool.load(_spec(f))
                except CallFailed as e:
                    if self._own_pool:  # the caller still owns what `closers` close
                        self.pool.close()
                    raise ValueError(f"reward function {f.name!r} ({f.kind}"
                                     f"{' ' + f.function if f.function else ''}): {e}") from None  # fmt: skip

    # ---- the Verifier protocol -----------------------------------------------------------------

    def verify(self, task: Task, completion: str) -> Score:
        """The per-sample components' weighted sum; RewardDropped when one gave no reward."""
        prompt, columns = reward_inputs(task)
        values: dict[str, float | None] = {}
        reasons: list[str] = []
        for f in self.sample_fns:
            if f.gate and (values.get(f.gate) or 0.0) < 0.5:
                values[f.name] = 0.0
                reasons.append(f"{f.name}=0 (gate {f.gate} closed)")
                continue
            if f.kind in POOL_KINDS:
                v = self._call(f, task, prompt, [completion], columns, "sample")[0]
                reasons.append(f"{f.name}={_fmt(v)}")
            else:
                v, reason = self.local[f.kind](task, completion)
                reasons.append(f"{f.name}={_fmt(v)}" + (f" ({reason})" if reason else ""))
            values[f.name] = v
            self._count(f, [v])
        return Score(self._sum(values), " ".join(reasons), values)

    def score_group(self, task: Task, completions: list[str]) -> list[Score] | None:
        """The group components' scores of a finished group (each Score adds to its episode's
        reward), or None when no function scores groups. RewardDropped as for `verify`."""
        if not self.group_fns:
            return None
        prompt, columns, per_completion = group_reward_inputs(task, len(completions))
        per_fn = {f.name: self._call(f, task, prompt, completions, columns, "group",
                                     per_completion) for f in self.group_fns}  # fmt: skip
        out = []
        for i in range(len(completions)):
            values = {name: vals[i] for name, vals in per_fn.items()}
            out.append(Score(self._sum(values),
                             " ".join(f"{k}={_fmt(v)}" for k, v in values.items()), values))  # fmt: skip
        for f in self.group_fns:
            self._count(f, per_fn[f.name])
        return out

    def close(self) -> None:
        try:
            if self._own_pool and self.pool is not None:
                self.pool.close()
        finally:
            for c in self._closers:
                c()

    # ---- `slipstream task check` ---------------------------------------------------------------

    def check(self, task: Task, completion: str) -> dict[str, float | None | str]:
        """Every function's result for one completion, no retries: a score, None (not
        applicable), or "error: <what>" (a group function scores it as a group of 1; a gated
        function is computed regardless of its gate)."""
        prompt, columns = reward_inputs(task)
        out: dict[str, float | None | str] = {}
        for f in self.cfg.functions:
            try:
                if f.kind in POOL_KINDS:
                    out[f.name] = self._once(f, task, prompt, [completion], columns)[0]
                else:
                    out[f.name] = float(self.local[f.kind](task, completion)[0])
            except Exception as e:  # noqa: BLE001 - reported per function (CallFailed included)
                out[f.name] = f"error: {e}"
        return out

    # ---- calls ---------------------------------------------------------------------------------

    def _once(self, f: RewardFunctionConfig, task: Task, prompt: Any, texts: list[str],
              columns: dict[str, Any], per_completion: dict[str, list[Any]] | None = None,
              ) -> list[float | None]:  # fmt: skip
        """One call of `f`: each column's value repeated per completion, `per_completion`'s
        lists (a group's agent-episode inputs, one entry per completion) as they are."""
        assert self.pool is not None
        n = len(texts)
        spec = _spec(f)
        comps = [as_completion(prompt, t) for t in texts]
        if f.batched:
            kwargs = {k: [v] * n for k, v in columns.items()}
            kwargs.update(per_completion or {})
            kwargs.update(prompts=[prompt] * n, completions=comps)
            if f.kind != "python":  # the built-in kinds read the reference answer here
                kwargs["reference"] = [_reference(f, task, columns)] * n
        else:
            kwargs = dict(columns)
            kwargs.update(prompt=prompt, completion=comps[0])
        return self.pool.call(spec, kwargs, n, f.timeout_s)

    def _call(self, f: RewardFunctionConfig, task: Task, prompt: Any, texts: list[str],
              columns: dict[str, Any], what: str,
              per_completion: dict[str, list[Any]] | None = None) -> list[float | None]:  # fmt: skip
        st = self._stats[f.name]
        last: CallFailed | None = None
        for _ in range(1 + self.cfg.retries):
            try:
                values = self._once(f, task, prompt, texts, columns, per_completion)
            except CallFailed as e:
                last = e
                fatal = self._failed(f, st, e, texts[0])
                if fatal:
                    raise RewardDropped(fatal, fatal=fatal) from None
                continue
            with self._lock:
                st.calls += 1
                st.consecutive_failures = 0
            return values
        assert last is not None
        with self._lock:
            st.dropped += 1
        raise RewardDropped(f"reward function {f.name!r} gave no reward for this {what} of task "
                            f"{task.task_id} after {1 + self.cfg.retries} calls: {last}")  # fmt: skip

    def _failed(self, f: RewardFunctionConfig, st: FunctionStats, e: CallFailed,
                example: str) -> str:  # fmt: skip
        """Count a failed call (log the first of each kind once); -> the fatal message when the
        function failed max_consecutive_failures calls in a row, else ""."""
        with self._lock:
            st.calls += 1
            st.failed_calls += 1
            st.consecutive_failures += 1
            first = e.kind not in st.logged
            st.logged.add(e.kind)
            n = st.consecutive_failures
        if first:
            log.error("reward function %r: %s (%s; the sample is retried, then its group "
                      "dropped; further %s failures are counted, not logged); completion: %r",
                      f.name, e, e.kind, e.kind, example[:200])  # fmt: skip
        if n >= self.cfg.max_consecutive_failures:
            return (f"reward function {f.name!r} failed on {n} consecutive calls "
                    f"(reward.max_consecutive_failures); last: {e}")  # fmt: skip
        return ""

    def _count(self, f: RewardFunctionConfig, values: list[float | None]) -> None:
        st = self._stats[f.name]
        with self._lock:
            for v in values:
                st.scores += 1
                if v is None:
                    st.none += 1
                else:
                    st.total += v

    def _sum(self, values: dict[str, float | None]) -> float:
        weights = {f.name: f.weight for f in self.cfg.functions}
        return float(sum(weights[k] * v for k, v in values.items() if v is not None))

    def reward_stats(self) -> dict[str, float]:
        """Counters per function, `reward_<name>_<counter>` (the worker reports them)."""
        out: dict[str, float] = {}
        with self._lock:
            for name, st in self._stats.items():
                for key in ("calls", "failed_calls", "dropped", "scores", "none", "total"):
                    out[f"reward_{name}_{key}"] = float(getattr(st, key))
        return out


def _spec(f: RewardFunctionConfig) -> FunctionSpec:
    return FunctionSpec(f.kind, f.function, f.batched, f.pattern, f.answer_key, f.timeout_s)


def _reference(f: RewardFunctionConfig, task: Task, columns: dict[str, Any]) -> Any:
    """The reference answer a built-in kind compares with: its `answer_key` column, else the
    task's reference answer (`meta["answer"]`)."""
    return columns.get(f.answer_key) if f.answer_key else task.meta.get("answer")


def _fmt(v: float | None) -> str:
    return "None" if v is None else f"{v:.4g}"
