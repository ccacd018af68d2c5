"""verifiers (PyPI `verifiers` 0.4, `verifiers.v1`) environments, run unchanged as slipstream
agent episodes. docs/verifiers.md is the guide.

A verifiers environment is a taskset (typed tasks whose `@vf.reward(weight=...)` methods score
a trace), a harness (the program that talks to the model: `null` is a plain chat loop) and an
`Env` (how one task becomes one episode: `SingleAgentEnv`, or a subclass driving a multi-turn
exchange). Every model call goes through an OpenAI-compatible client. So each slipstream episode
runs this module as the `agent` program (`task.env = "agent"`):

    python -m slipstream.envs.verifiers_env run  --taskset ID [--env ID] [--harness null]
    python -m slipstream.envs.verifiers_env export --taskset ID --out tasks.jsonl [--limit N]

`run` (the agent, once per episode, envs/agent.py starts it): reads the slipstream task on stdin,
picks the verifiers task it was exported from (`vf_idx`, checked against its `vf_key`), runs
`Env.run_episode` with the episode's endpoint (`OPENAI_BASE_URL`, `OPENAI_API_KEY`,
`OPENAI_MODEL`) as the model client, and writes `result.json`: the trace's weighted reward
(`Trace.reward`, the sum of score * weight), each reward's score and weight, the metrics and the
turn count. Every model call the harness made reached the endpoint, so the episode's samples
are token-exact as for any agent (envs/agent_trajectory.py). A failed episode (the trace or
the episode carries errors) exits 1, so slipstream re-runs it and never trains on it.

`export`: the taskset's tasks as JSON lines for `task.name = "dataset"` (TRL layout): `prompt`
(the task's prompt: text or chat messages), `answer` (the task data's `answer` field, when it
has one), `vf_idx`, `vf_key` and `vf_data` (the task's wire data).

`episode_reward` is the `[[reward.functions]]` entry that makes that weighted reward the
episode's: `{name = "verifiers", kind = "python", function =
"slipstream.envs.verifiers_env:episode_reward", batched = false}`.

Tools (`vf.Toolset`, MCP) work: verifiers starts each tool server as `python -m MODULE` in its
subprocess runtime (so `--path` is exported as PYTHONPATH too); the endpoint parses the model's
Hermes `<tool_call>` blocks into `tool_calls`.

Not covered: harnesses that need a container runtime (every one but `null` and `bash`: they
need docker/podman/prime), `SandboxEnv`-style tasksets (`NEEDS_CONTAINER`), verifiers' own
trainer client (`TrainClientConfig`) and env server. The runtime is verifiers'
`subprocess` one: the harness program runs as a child of this agent process, in its group.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

RESULT_FILE = "result.json"


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise SystemExit(
            f"verifiers is not installed ({e}); pip install 'verifiers==0.4.0' "
            "(the `verifiers` extra: it pins openai<3, see docs/verifiers.md)"
        ) from None
    return vf


def env_config(taskset: str, env: str = "", harness: str = "null", **extra: Any) -> Any:
    """The verifiers env config: taskset `taskset`, env `env` (its own or SingleAgentEnv), every
    agent seat on `harness` in verifiers' local `subprocess` runtime."""
    vf = _vf()
    seat = {"harness": {"id": harness}, "runtime": {"type": "subprocess"}}
    raw: dict[str, Any] = {"taskset": {"id": taskset}, "id": env, **extra}
    cls = vf.env_config_type(taskset, env)
    for name in _agent_fields(cls):
        raw.setdefault(name, seat)
    return vf.resolve_env_config(raw)


def _agent_fields(cls: type) -> list[str]:
    """The env config's agent seats (its `AgentConfig` fields)."""
    vf = _vf()
    return [n for n, f in cls.model_fields.items() if f.annotation is vf.AgentConfig]


def task_at(env: Any, idx: int) -> Any:
    """The env's taskset's task at position `idx` (IndexError past its end)."""
    for task in itertools.islice(iter(env.taskset), idx, idx + 1):
        return task
    raise IndexError(f"verifiers taskset {env.config.taskset.id!r} has no task {idx}")


def export_rows(env: Any, limit: int | None = None) -> list[dict[str, Any]]:
    """The taskset's tasks as `task.name = "dataset"` rows (see the module docstring)."""
    rows = []
    for task in itertools.islice(iter(env.taskset), limit):
        data = task.data.model_dump(mode="json", exclude_none=True)
        prompt = data.get("prompt")
        if prompt is None:
            raise ValueError(f"task {task.data.idx}: no prompt (the user opens it); "
                             "a slipstream task needs one")  # fmt: skip
        row = {"prompt": prompt, "vf_idx": task.data.idx, "vf_key": task.key, "vf_data": data}
        if "answer" in data:
            row["answer"] = data["answer"]
        rows.append(row)
    return rows


def _row_of(stdin_task: dict[str, Any]) -> dict[str, Any]:
    """The exported row a slipstream task (Task.to_dict) came from: its columns."""
    meta = stdin_task.get("meta") or {}
    cols = meta.get("columns") or {}
    if "vf_idx" not in cols:
        raise ValueError(f"task {stdin_task.get('task_id')}: no vf_idx column (tasks must come "
                         "from `python -m slipstream.envs.verifiers_env export`)")  # fmt: skip
    return cols


async def run_episode(env: Any, task: Any, base_url: str, api_key_var: str, model: str) -> Any:
    """One verifiers episode of `task` with the model at `base_url` (key in $api_key_var)."""
    vf = _vf()
    ctx = vf.ModelContext(model=model,
                          client=vf.EvalClientConfig(base_url=base_url, api_key_var=api_key_var))  # fmt: skip
    async with env.serving():
        return await env.run_episode(task, ctx)


def episode_result(episode: Any) -> dict[str, Any]:
    """What the agent reports (result.json): the trainable trace's weighted reward and parts."""
    traces = [t for t in episode.traces if t.agent is None or t.agent.trainable]
    if len(traces) != 1:
        raise ValueError(f"the episode has {len(traces)} trainable traces; one is supported")
    (trace,) = traces
    return {
        "reward": trace.reward,
        "rewards": {
            k: (None if r is None else {"score": r.score, "weight": r.weight})
            for k, r in trace.rewards.items()
        },  # fmt: skip
        "metrics": dict(trace.metrics),
        "turns": trace.num_turns,
        "last_reply": trace.last_reply,
    }


def _errors(episode: Any) -> list[str]:
    errs = [f"{e.type}: {e.message}" for e in episode.errors]
    for t in episode.traces:
        errs += [f"{e.type}: {e.message}" for e in t.errors]
    return errs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slipstream.envs.verifiers_env")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "export"):
        s = sub.add_parser(name)
        s.add_argument("--taskset", required=True, help="verifiers taskset id (a module name)")
        s.add_argument("--env", default="", help="verifiers env id (default: the taskset's own)")
        s.add_argument("--harness", default="null", help="harness of every agent seat")
        s.add_argument("--path", action="append", default=[],
                       help="a folder to import the taskset / env from (repeatable)")  # fmt: skip
    sub.choices["run"].add_argument(
        "--uv-cache", default="",
        help="UV_CACHE_DIR for the harness program's environment (default: uv's, under the "
             "episode's fresh HOME: every episode would resolve its packages again)")  # fmt: skip
    sub.choices["export"].add_argument("--out", required=True)
    sub.choices["export"].add_argument("--limit", type=int, default=None)
    a = p.parse_args(argv)
    paths = [str(Path(x).resolve()) for x in a.path]
    sys.path[:0] = paths
    # verifiers starts tool servers as `python -m MODULE` (vf.Toolset): they import from here too
    os.environ["PYTHONPATH"] = ":".join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = _vf().load_environment(env_config(a.taskset, a.env, a.harness))
    if a.cmd == "export":
        rows = export_rows(env, a.limit)
        with open(a.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print(f"{len(rows)} tasks -> {a.out}")
        return 0
    # verifiers' runtime runs the harness program with `uv` (PEP 723 script): the one next to
    # this interpreter (the `verifiers` extra installs it) before a per-HOME install of its own
    os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    if a.uv_cache:
        os.environ["UV_CACHE_DIR"] = a.uv_cache
    cols = _row_of(json.load(sys.stdin))
    task = task_at(env, int(cols["vf_idx"]))
    if task.key != cols.get("vf_key"):
        raise ValueError(f"verifiers task {cols['vf_idx']} changed since it was exported "
                         f"(key {task.key[:12]} != {str(cols.get('vf_key'))[:12]}); export again")  # fmt: skip
    episode = asyncio.run(run_episode(env, task, os.environ["OPENAI_BASE_URL"], "OPENAI_API_KEY",
                                      os.environ.get("OPENAI_MODEL", "policy")))  # fmt: skip
    errs = _errors(episode)
    if errs:
        print(f"verifiers episode failed: {errs[0][-2000:]}", file=sys.stderr)
        return 1
    Path(RESULT_FILE).write_text(json.dumps(episode_result(episode)))
    return 0


def episode_reward(prompt: Any, completion: Any, agent_output: Any = None, **columns: Any) -> float:
    """`[[reward.functions]]` (batched = false): the verifiers episode's weighted reward, as its
    agent reported it. ValueError when the episode reported none (not a verifiers episode)."""
    if not isinstance(agent_output, dict) or not isinstance(
        agent_output.get("reward"), int | float
    ):
        raise ValueError("no verifiers reward in the agent's output (is agent.command "
                         "`python -m slipstream.envs.verifiers_env run ...`?)")  # fmt: skip
    return float(agent_output["reward"])


if __name__ == "__main__":
    sys.exit(main())
