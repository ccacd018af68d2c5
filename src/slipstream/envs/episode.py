"""The one episode loop: G episodes of a task, each an Environment driven by an Engine, turn by
turn, token in and token out. The rollout worker runs every task through it (single-turn tasks
are one-step environments) and so does the held-out evaluation of multi-turn environments.

    runner = EpisodeRunner(engine, make_env, tokenizer, limits, executor, temperature=1.0)
    rollout = runner.start(task, n=8, seed=None, on_done=callback)   # returns at once
    rollout.abort()                                                   # e.g. the lease died
    callback(GroupOutcome(status, episodes, infra_failures, error))  # exactly once

How a group runs:
1. On the executor: one environment per episode (`make_env()`), `reset(task)` each. When all G
   first observations are equal (every built-in environment) the first turn is ONE request
   with n = G, so the engine prefills the shared prompt once (group prefix sharing); otherwise
   one request per episode.
2. Each turn's completion goes to its episode's `env.step(sampled ids, last=...)` on the
   executor (never on the engine's thread). The sampled ids, their behaviour logprobs and
   per-token versions are appended as the engine returned them (mask 1); the observation ids
   as the environment returned them (mask 0). `last` is set when no further turn may follow:
   `max_turns` reached, fewer than `max_observation_tokens + 1` completion tokens left of the
   episode budget, or the episode past `episode_timeout_s`.
3. The next turn re-submits the whole sequence so far as the prompt (n = 1, at most
   `max_turn_tokens` new tokens, the environment's stop strings). Re-prefill costs are counted
   per episode (`prefill_tokens`; `reprefill_tokens` = what an engine keeping the episode's KV
   between turns would not have had to prefill again).
4. An InfraError from `reset` or `step` closes that episode's environment (its sandbox goes
   back) and re-runs the episode from `reset` with a fresh seed, at most `max_infra_retries`
   times; one more and the group is given up (`status = "dropped"`, the other episodes are
   aborted). A failed attempt's tokens are discarded: nothing of it can be trained on. A
   `ServiceUnavailable` (a reward-model server that did not answer) gives the group up at once
   as `aborted`: the worker nacks it and the task is redelivered, never rewarded. A
   `RewardDropped` (a reward function gave no reward after its retries) drops the group at once
   (`dropped`, counted), never rewarded, and never re-run.
5. Once all G episodes are done, the runner's `group_scorer` (group reward functions) adds its
   scores to their rewards; RewardDropped there drops the group too.
6. Every environment is closed exactly once, however its episode ends (done, aborted, failed,
   dropped), before `on_done` runs.
7. `GroupRollout.generating` is False while the group has no request in the engine and only its
   environment steps run (rewards, verification, tool runs); `on_engine_idle` (given to
   `start`) is called as its last request returns. The worker counts generating groups apart
   from groups waiting on rewards (`rollout.max_scoring_tasks`).

Statuses: `done` (G finished episodes, rewards from the environments), `aborted` (`abort()`
or an engine abort, e.g. a weight update under the "abort" policy), `failed` (the engine
raised), `dropped` (infrastructure kept failing). Only `done` carries trainable episodes.

Not covered: bounding generation time by the turn timeout (it bounds tool runs; the episode
timeout is checked between turns), keeping an episode's KV cache between turns (the engine has
no session API yet: docs/envs.md), episodes of one group with different first observations
sharing a prefill.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from slipstream.engine.base import Completion, Engine, GenerateRequest, SamplingParams
from slipstream.envs.agent_trajectory import REWARD_INPUTS_KEY
from slipstream.envs.base import (
    EnvFactory,
    Environment,
    EnvUsage,
    EpisodeLimits,
    InfraError,
    RewardDropped,
    Score,
    ServiceUnavailable,
)
from slipstream.tasks import Task

log = logging.getLogger(__name__)
Status = Literal["done", "aborted", "failed", "dropped"]
GroupScorer = Callable[[Task, list[str]], "list[Score] | None"]
"""(task, the group's completion texts) -> a Score per completion, added to its episode's reward,
or None (no group reward functions); RewardDropped when one gave no reward."""


@dataclass
class Episode:
    """One episode as it ran: the first observation, then sampled and observation tokens."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    """Per completion token: 1 sampled, 0 observation."""
    logprobs: list[float] = field(default_factory=list)
    """Behaviour logprobs of the sampled tokens only, in order."""
    versions: list[int] = field(default_factory=list)
    """Policy version of each sampled token only, in order."""
    reward: float = 0.0
    reason: str = ""
    finish_reason: str = "stop"
    """The engine's finish reason of the last turn."""
    text: str = ""
    """The decoded completion (turns and observations), for logs and reports."""
    num_turns: int = 0
    usage: EnvUsage = field(default_factory=EnvUsage)
    env_s: float = 0.0
    """Wall time inside the environment (reset + steps) of the attempt that finished."""
    infra_retries: int = 0
    """Earlier attempts that ended in an InfraError."""
    prefill_tokens: int = 0
    """Prompt tokens this episode's requests submitted (its share of a group request)."""
    reprefill_tokens: int = 0
    """Of those, tokens whose KV the engine had computed in the episode's previous turn."""
    routed_experts: Any = None
    """(P + C - 1, L, k) routing stitched across turns (torch tensor), or None."""
    reward_components: dict[str, float | None] = field(default_factory=dict)
    """The reward's components by name (`[[reward.functions]]`, group functions included)."""
    episode_index: int = -1
    """The episode's index in its group when it yields several samples (an agent that rewrote
    its history: envs/agent_trajectory.py); -1: the episode is one sample."""
    reward_inputs: dict[str, Any] | None = None
    """An agent episode's extra reward-function inputs by name (`messages`, `agent_output`:
    envs/agent.py), which group reward functions get one per episode; None for other
    environments."""


@dataclass
class GroupOutcome:
    status: Status
    episodes: list[Episode]
    infra_failures: int = 0
    """InfraErrors of this group's episodes (retried or not)."""
    error: str = ""
    requests: int = 0
    """Engine requests the group made (its first turn is one request for all G)."""
    generate_s: float = 0.0
    """Summed latency of those requests (submit -> completion)."""
    fatal: str = ""
    """A reward function failed `reward.max_consecutive_failures` calls in a row: the job must
    stop with this one-line message (the worker tells the coordinator)."""


@runtime_checkable
class AgentDriven(Protocol):
    """An environment whose episode is driven by a program of its own (an agent process calling
    the engine through an endpoint), not turn by turn by this loop: `run` blocks until the
    episode ended and returns its samples (one, or several when the agent rewrote its history),
    rewarded; InfraError when it failed (re-run, never a reward). `stopped()` says the group was
    aborted: the run must end soon (its calls are aborted)."""

    def run(self, task: Task, stopped: Callable[[], bool]) -> list[Episode]: ...


def derived_seed(seed: int, episode: int, turn: int, attempt: int) -> int:
    """The sampling seed of a request other than a group's first turn."""
    return (seed * 1_000_003 + episode * 7919 + turn * 104_729 + attempt * 15_485_863) % (1 << 62)


class _Ep:
    """One episode's mutable state; touched by one thread at a time (its turn's)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.env: Environment | None = None
        self.data: Episode | None = None
        self.failures = 0
        self.request_id = ""
        self.t_start = 0.0
        self.end: Status | None = None
        self.last_obs_len = 0
        self._routing_rows = 0
        self._routing: list[Any] = []
        self.extra: list[Episode] = []  # an agent episode's further samples

    def close_env(self) -> None:
        env, self.env = self.env, None
        if env is not None:
            env.close()

    def sequence(self) -> list[int]:
        assert self.data is not None
        return self.data.prompt_ids + self.data.completion_ids

    def add_turn(self, c: Completion, tokenizer: Any) -> None:
        d = self.data
        assert d is not None
        d.completion_ids.extend(c.token_ids)
        d.loss_mask.extend([1] * len(c.token_ids))
        d.logprobs.extend(c.logprobs)
        d.versions.extend(c.versions)
        d.num_turns += 1
        d.finish_reason = c.finish_reason
        d.text += tokenizer.decode(c.token_ids)
        if c.routed_experts is not None:
            # rows [0, R) came from earlier turns (each row from the turn that first fed that
            # position); this turn adds its prefill of the new positions and its decode rows
            self._routing.append(c.routed_experts[self._routing_rows :])
            self._routing_rows = int(c.routed_experts.shape[0])

    def add_observation(self, ids: list[int], tokenizer: Any) -> None:
        d = self.data
        assert d is not None
        d.completion_ids.extend(ids)
        d.loss_mask.extend([0] * len(ids))
        self.last_obs_len = len(ids)
        d.text += tokenizer.decode(ids)

    def stitched_routing(self) -> Any:
        if not self._routing:
            return None
        import torch

        return torch.cat(self._routing) if len(self._routing) > 1 else self._routing[0]

    def restart(self) -> None:
        self.data, self.request_id, self.end = None, "", None
        self.last_obs_len, self._routing_rows, self._routing = 0, 0, []
        self.extra = []


class EpisodeRunner:
    """Runs groups of episodes (see the module docstring). Thread-safe; one per engine."""

    def __init__(
        self,
        engine: Engine,
        make_env: EnvFactory,
        tokenizer: Any,
        limits: EpisodeLimits,
        executor: Executor,
        *,
        temperature: float = 1.0,
        record_routing: bool = False,
        context_tokens: int = 0,
        reset_threads: int = 8,
        group_scorer: GroupScorer | None = None,
    ) -> None:
        """`executor` runs the environments' steps; resets (which may wait for a sandbox) run
        on the runner's own `reset_threads` threads, so episodes waiting for a sandbox never
        hold the threads that the episodes holding one need to finish and give it back.
        `context_tokens`: the engine's context (prompt + completion) when known (the native
        engine's slot length); 0 = unknown (then `limits.max_episode_tokens` must bound the
        episode or the engine's own limit will end it). `group_scorer(task, texts)`: rewards
        added to a group's episodes once all of them finished (the worker's group reward
        functions; None from it = none). Call `close()` when done."""
        from concurrent.futures import ThreadPoolExecutor

        self.reset_executor = ThreadPoolExecutor(reset_threads, thread_name_prefix="episode-reset")
        self.engine = engine
        self.make_env = make_env
        self.tokenizer = tokenizer
        self.limits = limits
        self.executor = executor
        self.temperature = temperature
        self.record_routing = record_routing
        self.context_tokens = context_tokens
        self.group_scorer = group_scorer
        self._log_lock = threading.Lock()
        self.num_infra_logged = 0

    def start(self, task: Task, n: int, on_done: Callable[[GroupOutcome], None],
              seed: int | None = None, *,
              on_engine_idle: Callable[[], None] | None = None) -> GroupRollout:  # fmt: skip
        """Start a group (returns at once). `on_engine_idle()`: called (on the engine's thread)
        each time the group's last request in the engine returns, e.g. when a single-turn group
        leaves generation for its rewards (`GroupRollout.generating`)."""
        rollout = GroupRollout(self, task, n, seed, on_done, on_engine_idle)
        rollout.schedule(rollout.eps, rollout.begin, on=self.reset_executor)
        return rollout

    def close(self) -> None:
        """Stop the reset threads (after the last group ended; resets still queued run inline
        in whichever thread schedules them)."""
        self.reset_executor.shutdown(wait=True)

    def budget(self, prompt_len: int) -> int:
        """Most completion tokens (sampled + observations) of an episode with this prompt."""
        caps = []
        if self.limits.max_episode_tokens:
            caps.append(self.limits.max_episode_tokens)
        if self.context_tokens:
            caps.append(self.context_tokens - prompt_len)
        if not caps:
            lim = self.limits
            caps.append(lim.max_turns * (lim.max_turn_tokens + lim.max_observation_tokens))
        return max(0, min(caps))

    def log_infra(self, what: str, error: BaseException) -> None:
        with self._log_lock:
            self.num_infra_logged += 1
            n = self.num_infra_logged
        if n <= 3 or n % 100 == 0:  # loud but bounded: a broken pool fails every episode
            log.error("episode infrastructure failure #%d (%s; re-run, never a reward): %s",
                      n, what, error)  # fmt: skip


class GroupRollout:
    """G episodes of one task (built by EpisodeRunner.start)."""

    def __init__(self, runner: EpisodeRunner, task: Task, n: int, seed: int | None,
                 on_done: Callable[[GroupOutcome], None],
                 on_engine_idle: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.runner = runner
        self.task = task
        self.n = n
        self.seed = seed
        self.on_done = on_done
        self.on_engine_idle = on_engine_idle
        self._in_engine = 0  # requests submitted whose completions have not returned
        self._submitted = False  # a first request went to the engine
        self.eps = [_Ep(i) for i in range(n)]
        self._lock = threading.Lock()
        self._open = n
        self._aborted = False
        self._dropped = False
        self._error = ""
        self._fatal = ""
        self.infra_failures = 0
        self.requests = 0
        self.generate_s = 0.0

    # ---- control -------------------------------------------------------------------------------

    def abort(self) -> None:
        """Stop the group: live requests are aborted, running steps finish, then every episode
        ends as aborted (environments closed); on_done still runs once."""
        with self._lock:
            self._aborted = True
            rids = {ep.request_id for ep in self.eps if ep.request_id and ep.end is None}
        for rid in rids:
            self.runner.engine.abort(rid)

    @property
    def aborted(self) -> bool:
        return self._aborted

    @property
    def generating(self) -> bool:
        """The group holds (or is about to hold) engine work: from its start until its first
        requests went out, and while any request of it is in the engine. False while only its
        environment steps run (reward functions, verification, tool runs): a single-turn group
        after its completions returned, a multi-turn one between turns (it may generate again).
        Agent-driven groups call the engine on their own and count as generating throughout.
        The worker caps generating groups separately from groups that only wait on rewards,
        so slow rewards overlap newer groups' generation (rollout.max_scoring_tasks)."""
        with self._lock:
            return not self._submitted or self._in_engine > 0

    def schedule(self, owners: list[_Ep], fn: Callable[..., None], *args: Any,
                 on: Executor | None = None) -> None:  # fmt: skip
        """Run fn(*args) for the episodes `owners` on the step executor (or `on`); inline when
        it no longer takes work (the worker is shutting down)."""
        try:
            (on or self.runner.executor).submit(self._guard, owners, fn, *args)
        except RuntimeError:
            self._guard(owners, fn, *args)

    def _guard(self, owners: list[_Ep], fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a bug in one episode must end its group, not hang it
            log.exception("episode of task %s failed", self.task.task_id)
            with self._lock:
                self._error = self._error or f"{type(e).__name__}: {e}"
            for ep in owners:
                self._end(ep, "failed")

    # ---- turns ---------------------------------------------------------------------------------

    def begin(self) -> None:
        ready = [ep for ep in self.eps if self._reset(ep)]
        if not ready:
            return
        if isinstance(ready[0].env, AgentDriven):
            for ep in ready:
                self._drive(ep)
            return
        prompts = [ep.data.prompt_ids for ep in ready if ep.data is not None]
        if len(ready) == self.n and all(p == prompts[0] for p in prompts):
            self._submit(ready, prompts[0], self.n, turn=0)
        else:
            for ep in ready:
                self._submit([ep], ep.sequence(), 1, turn=0)

    def _reset(self, ep: _Ep) -> bool:
        """A fresh environment reset on the task (re-tried on InfraError); False when the
        episode ended instead (aborted, or the group was given up)."""
        while True:
            if self._aborted:
                self._end(ep, "aborted")
                return False
            ep.restart()
            ep.t_start = time.monotonic()
            try:
                ep.env = self.runner.make_env()
                ids = ep.env.reset(self.task)
            except InfraError as e:
                if not self._infra(ep, e, "reset"):
                    return False
                continue
            ep.data = Episode(prompt_ids=list(ids), infra_retries=ep.failures)
            ep.data.env_s = time.monotonic() - ep.t_start
            return True

    def _restart(self, ep: _Ep) -> None:
        """Re-run an episode from its reset (after an infrastructure failure)."""
        if self._reset(ep):
            if isinstance(ep.env, AgentDriven):
                self._drive(ep)
            else:
                self._submit([ep], ep.sequence(), 1, turn=0)

    def _drive(self, ep: _Ep) -> None:
        """An agent-driven episode: its run blocks for the agent's lifetime, so it gets a thread
        of its own (the step and reset threads stay free)."""
        threading.Thread(target=self._guard, args=([ep], self._agent_run, ep), daemon=True,
                         name=f"agent-{self.task.task_id}-{ep.index}").start()  # fmt: skip

    def _agent_run(self, ep: _Ep) -> None:
        env, d = ep.env, ep.data
        assert isinstance(env, AgentDriven) and d is not None
        try:
            episodes = env.run(self.task, lambda: self._aborted)
        except InfraError as e:
            if self._infra(ep, e, "agent"):
                self.schedule([ep], self._restart, ep, on=self.runner.reset_executor)
            return
        if self._aborted:
            self._end(ep, "aborted")
            return
        if not episodes:  # the run saw the group aborted
            self._end(ep, "aborted")
            return
        for e in episodes:
            e.infra_retries = ep.failures
            e.env_s += d.env_s
            if len(episodes) > 1:
                e.episode_index = ep.index
        with self._lock:
            self.requests += sum(e.num_turns for e in episodes)
        ep.data, ep.extra = episodes[0], episodes[1:]
        self._end(ep, "done")

    def _submit(self, eps: list[_Ep], prompt: list[int], n: int, *, turn: int) -> None:
        first = eps[0]
        env, d = first.env, first.data
        assert env is not None and d is not None
        lim, runner = self.runner.limits, self.runner
        room = runner.budget(len(d.prompt_ids)) - len(d.completion_ids)
        if self.seed is None:
            seed = None
        elif n > 1:
            seed = self.seed
        else:
            seed = derived_seed(self.seed, first.index, turn, first.failures)
        params = SamplingParams(
            temperature=runner.temperature, max_new_tokens=max(1, min(lim.max_turn_tokens, room)),
            n=n, seed=seed, stop=env.stop, return_routed_experts=runner.record_routing,
        )  # fmt: skip
        req = GenerateRequest(list(prompt), params)
        with self._lock:
            aborted = self._aborted
            if not aborted:
                for ep in eps:
                    ep.request_id = req.request_id
                self._submitted = True
                self._in_engine += 1
        if aborted:
            for ep in eps:
                self._end(ep, "aborted")
            return
        for ep in eps:
            assert ep.data is not None
            ep.data.prefill_tokens += len(prompt) // n
            if turn:  # the previous turn's KV held all of it but the observation and the
                # last sampled token (never fed back): a KV-keeping session would prefill those
                ep.data.reprefill_tokens += len(prompt) - ep.last_obs_len - 1
        try:
            fut = runner.engine.submit(req)
        except (ValueError, RuntimeError) as e:  # a request the engine refuses, or a closed engine
            with self._lock:
                self._in_engine -= 1
                self._error = self._error or f"engine refused the request: {e}"
            for ep in eps:
                ep.request_id = ""
                self._end(ep, "failed")
            return
        t0 = time.monotonic()
        fut.add_done_callback(lambda f: self._on_generated(eps, f, t0))

    def _on_generated(self, eps: list[_Ep], fut: Future, t0: float) -> None:
        """On the engine's thread: count, and hand the turn to the executor."""
        with self._lock:
            self.requests += 1
            self.generate_s += time.monotonic() - t0
            self._in_engine -= 1
            idle = self._in_engine == 0
        self.schedule(eps, self._generated, eps, fut)
        if idle and self.on_engine_idle is not None:
            self.on_engine_idle()

    def _generated(self, eps: list[_Ep], fut: Future) -> None:
        error = fut.exception()
        if error is not None:
            with self._lock:
                self._error = self._error or f"generation failed: {error}"
            for ep in eps:
                self._end(ep, "failed")
            return
        comps: list[Completion] = fut.result()
        for ep in eps:
            ep.request_id = ""
        for ep, c in list(zip(eps, comps, strict=True))[1:]:
            self.schedule([ep], self._after_turn, ep, c)
        self._after_turn(eps[0], comps[0])

    def _after_turn(self, ep: _Ep, c: Completion) -> None:
        runner, lim = self.runner, self.runner.limits
        if ep.end is not None:  # ended meanwhile (its group failed)
            return
        d, env = ep.data, ep.env
        assert d is not None and env is not None
        if self._aborted or c.finish_reason == "abort":
            self._end(ep, "aborted")
            return
        ep.add_turn(c, runner.tokenizer)
        left = runner.budget(len(d.prompt_ids)) - len(d.completion_ids)
        last = (
            d.num_turns >= lim.max_turns
            or left < lim.max_observation_tokens + 1
            or time.monotonic() - ep.t_start > lim.episode_timeout_s
        )
        t0 = time.monotonic()
        try:
            res = env.step(c.token_ids, last=last)
        except InfraError as e:
            if self._infra(ep, e, "step"):
                self.schedule([ep], self._restart, ep, on=runner.reset_executor)
            return
        finally:
            d.env_s += time.monotonic() - t0
        d.reward += res.reward
        d.reason = res.reason
        d.reward_components.update(res.components)
        if res.done or last:
            self._end(ep, "done")
            return
        obs = list(res.observation_ids)
        if len(obs) > lim.max_observation_tokens:
            raise ValueError(
                f"environment returned an observation of {len(obs)} tokens; "
                f"max_observation_tokens is {lim.max_observation_tokens}"
            )
        ep.add_observation(obs, runner.tokenizer)
        self._submit([ep], ep.sequence(), 1, turn=d.num_turns)

    # ---- ends ----------------------------------------------------------------------------------

    def _infra(self, ep: _Ep, error: InfraError, what: str) -> bool:
        """Count an infrastructure failure; True when the episode may be re-run."""
        self.runner.log_infra(f"task {self.task.task_id} episode {ep.index} {what}", error)
        ep.close_env()
        ep.request_id = ""
        # a shared service that did not answer: give the group up as aborted (its task is
        # requeued), without re-running into the same outage; a reward function that gave no
        # reward after its retries: drop the group at once (a re-run would not help)
        requeue = isinstance(error, ServiceUnavailable)
        reward_dropped = isinstance(error, RewardDropped)
        with self._lock:
            self.infra_failures += 1
            ep.failures += 1
            if reward_dropped and error.fatal:
                self._fatal = self._fatal or error.fatal
            give_up = (requeue or reward_dropped
                       or ep.failures > self.runner.limits.max_infra_retries)  # fmt: skip
            if requeue and not self._error:
                self._error = f"{what}: {error} (task requeued)"
            elif give_up and not requeue and not self._dropped:
                self._dropped = True
                self._error = f"{ep.failures} infrastructure failures in a row: {error}"
        if give_up:
            self.abort()
            self._end(ep, "aborted")
            return False
        return True

    def _end(self, ep: _Ep, status: Status) -> None:
        if ep.data is not None and ep.env is not None:
            ep.data.usage = ep.env.usage
            routing = ep.stitched_routing()
            if routing is not None:
                ep.data.routed_experts = routing
        ep.close_env()
        with self._lock:
            if ep.end is not None:
                return
            ep.end = status
            self._open -= 1
            finished = self._open == 0
        if finished:
            self._finish()

    def _finish(self) -> None:
        if not self._dropped and not self._aborted and all(ep.end == "done" for ep in self.eps):
            self._score_group()  # may drop or fail the group
        ends = {ep.end for ep in self.eps}
        status: Status
        if self._dropped:
            status = "dropped"
        elif "failed" in ends:
            status = "failed"
        elif "aborted" in ends:
            status = "aborted"
        else:
            status = "done"
        episodes = []
        if status == "done":
            episodes = [e for ep in self.eps if ep.data is not None for e in [ep.data, *ep.extra]]
        self.on_done(GroupOutcome(status, episodes, self.infra_failures, self._error,
                                  self.requests, self.generate_s, self._fatal))  # fmt: skip

    def _score_group(self) -> None:
        """The group reward functions, once every episode finished: each episode's reward grows
        by its score. A function that gave none drops the group (RewardDropped, counted); a
        bug fails it."""
        scorer = self.runner.group_scorer
        if scorer is None:
            return
        held = [ep for ep in self.eps if ep.data is not None]
        data = [ep.data for ep in held if ep.data is not None]
        try:
            scores = scorer(_group_task(self.task, data), [d.text for d in data])
        except RewardDropped as e:
            self.runner.log_infra(f"task {self.task.task_id} group reward", e)
            with self._lock:
                self.infra_failures += 1
                self._dropped = True
                self._error = self._error or str(e)
                self._fatal = self._fatal or e.fatal
            return
        except Exception as e:  # noqa: BLE001 - a bug must end the group loudly, never reward it
            log.exception("group reward of task %s failed", self.task.task_id)
            with self._lock:
                self._error = self._error or f"group reward: {type(e).__name__}: {e}"
            for ep in self.eps:
                ep.end = "failed"
            return
        if scores is None:
            return
        for ep, s in zip(held, scores, strict=True):
            for d in [ep.data, *ep.extra]:  # an agent episode's samples share its reward
                assert d is not None
                d.reward += s.reward
                d.reward_components.update(s.components)


def _group_task(task: Task, data: list[Episode]) -> Task:
    """`task` as the group scorer sees it: for agent episodes, a copy whose meta holds under
    `REWARD_INPUTS_KEY` each extra input as a list, one entry per episode in `data`'s order
    (rewards/rewardset.py `score_group` passes them as the functions' per-completion lists)."""
    inputs = [d.reward_inputs for d in data]
    if all(i is None for i in inputs):
        return task
    names = sorted({k for i in inputs if i is not None for k in i})
    per_episode = {k: [None if i is None else i.get(k) for i in inputs] for k in names}
    return Task(task.task_id, task.prompt, task.key,
                {**task.meta, REWARD_INPUTS_KEY: per_episode})  # fmt: skip


def run_episodes(
    runner: EpisodeRunner, tasks: list[Task], n: int = 1, seed: int | None = None,
    timeout_s: float = 3600.0,
) -> list[GroupOutcome]:  # fmt: skip
    """Run every task's group of n episodes through `runner` at once (the engine batches them)
    and wait for all; -> one outcome per task, in order. Per-task seeds are derived from `seed`
    (None: unseeded)."""
    done = threading.Condition()
    outcomes: list[GroupOutcome | None] = [None] * len(tasks)

    def finished(i: int, out: GroupOutcome) -> None:
        with done:
            outcomes[i] = out
            done.notify_all()

    for i, task in enumerate(tasks):
        task_seed = None if seed is None else derived_seed(seed, i, 0, 0)
        runner.start(task, n, lambda out, i=i: finished(i, out), task_seed)
    deadline = time.monotonic() + timeout_s
    with done:
        while any(o is None for o in outcomes):
            if not done.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"{sum(o is None for o in outcomes)} episode groups did not "
                                   f"finish within {timeout_s:g} s")  # fmt: skip
    return [o for o in outcomes if o is not None]
