"""Rollout environments: what an episode is (reset, then turns of model output -> observation,
reward, done), token in and token out, and the one episode loop that drives them through an
Engine. See docs/envs.md.

    make = make_env_factory(taskset, scorer=verifier.verify, sandboxes=host, limits=limits)
    runner = EpisodeRunner(engine, make, taskset.tokenizer, limits, executor)
    runner.start(task, n=8, on_done=...)

Environments (keyed by `task.env`):
- `single_turn` (default): the task's prompt, one turn, the verifier's reward (every built-in task).
- `python_tool`: the task's prompt; the policy may run `<py>...</py>` programs in the episode's
  sandbox (kept for the episode) before it answers; the verifier scores the answer.
- `agent`: the user's agent program, run once per episode against its own OpenAI-compatible
  endpoint (envs/agent.py; its factory is `AgentRuntime.factory`, which the worker builds).
- `code_tests`: the `code` task with visible tests: each turn is a solution, run against the
  visible tests in the episode's sandbox; failures come back as the observation; the last (or
  first fully passing) solution is scored on the hidden tests.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from slipstream.envs.base import (
    Demonstration,
    EnvFactory,
    Environment,
    EnvUsage,
    EpisodeLimits,
    InfraError,
    Scorer,
    ServiceUnavailable,
    StepResult,
    encode_observation,
)
from slipstream.envs.episode import (
    Episode,
    EpisodeRunner,
    GroupOutcome,
    GroupRollout,
    run_episodes,
)

if TYPE_CHECKING:
    from slipstream.envs.sandboxes import SandboxHost
    from slipstream.tasks import Task, TaskSet

ENVS: dict[str, str] = {
    "single_turn": "slipstream.envs.single_turn:SingleTurnEnv",
    "python_tool": "slipstream.envs.python_tool:PythonToolEnv",
    "code_tests": "slipstream.envs.code_tests:CodeTestsEnv",
    "agent": "slipstream.envs.agent:AgentEnv",
}


def env_class(name: str) -> Any:
    """The environment class registered as `name` (ValueError naming the known ones)."""
    if name not in ENVS:
        raise ValueError(f"task.env = {name!r}: not one of {sorted(ENVS)}")
    module, cls = ENVS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def env_needs_sandbox(name: str) -> bool:
    """Whether episodes of this environment hold a sandbox (the worker then owns a pool)."""
    return bool(env_class(name).needs_sandbox)


def make_env_factory(
    taskset: TaskSet,
    *,
    scorer: Scorer | None = None,
    sandboxes: SandboxHost | None = None,
    limits: EpisodeLimits | None = None,
    name: str | None = None,
) -> EnvFactory:
    """A factory of fresh environments for `taskset` (one per episode), keyed by `name`
    (default: the task set's `task.env`). `scorer` (default: the task set's own verifier)
    scores answers; `sandboxes` is required by environments that need one (InfraError at
    reset otherwise)."""
    cls = env_class(name or taskset.cfg.env)
    lim = limits or EpisodeLimits()

    def make() -> Environment:
        return cls(taskset, scorer=scorer, sandboxes=sandboxes, limits=lim)

    return make


_demo_envs: dict[tuple[int, str, int], Environment] = {}


def demonstration(taskset: TaskSet, task: Task, max_observation_tokens: int = 64) -> Demonstration:
    """The teacher's episode of `task` in the task set's environment (for SFT; runs nothing)."""
    key = (id(taskset), taskset.cfg.env, max_observation_tokens)
    env = _demo_envs.get(key)
    if env is None:
        limits = EpisodeLimits(max_observation_tokens=max_observation_tokens)
        env = make_env_factory(taskset, limits=limits)()
        _demo_envs.clear()  # one task set at a time (an SFT run)
        _demo_envs[key] = env
    return env.demonstration(task)


__all__ = [
    "ENVS",
    "Demonstration",
    "EnvFactory",
    "EnvUsage",
    "Environment",
    "Episode",
    "EpisodeLimits",
    "EpisodeRunner",
    "GroupOutcome",
    "GroupRollout",
    "InfraError",
    "ServiceUnavailable",
    "Scorer",
    "StepResult",
    "demonstration",
    "encode_observation",
    "env_class",
    "env_needs_sandbox",
    "make_env_factory",
    "run_episodes",
]
