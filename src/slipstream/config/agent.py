"""`[agent]`: the user's agent program that `task.env = "agent"` runs once per episode
(docs/agents.md)."""

from pydantic import Field, field_validator

from slipstream.config.base import Section


class AgentConfig(Section):
    command: str = ""
    """The agent's command line, run by `/bin/sh -c` in a fresh work directory, once per episode:
    the task as JSON on stdin; `OPENAI_BASE_URL`, `OPENAI_API_KEY` and `OPENAI_MODEL` name the
    episode's own endpoint. `{python}` is replaced by the worker's Python interpreter (which has
    the `openai` package), `{cwd}` by the directory the job was started in (the agent itself
    runs in a fresh directory). Required when task.env = "agent"."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for the agent (the rest of the worker's environment is not
    passed on: only PATH, LANG, HOME = the work directory and these)."""
    timeout_s: float = Field(default=120.0, gt=0, le=86_400)
    """Wall-clock bound of one agent run; past it the agent's whole process group is killed and
    the episode is a failure (re-run, never a reward)."""
    max_calls: int = Field(default=0, ge=0, le=10_000)
    """Most model calls per episode (calls past it are refused with 403); 0 = rollout.max_turns."""
    max_sampled_tokens: int = Field(default=0, ge=0)
    """Most tokens the policy may sample over one episode's calls; 0 = max_calls x the turn's
    token cap (rollout.max_new_tokens)."""
    result_file: str = "result.json"
    """A JSON file the agent may write in its work directory: its output (else its stdout, when
    that parses as JSON), handed to reward functions as `agent_output`."""
    memory_mib: int = Field(default=2048, ge=64, le=1 << 20)
    """Address-space limit of the agent's processes (RLIMIT_AS)."""
    max_output_bytes: int = Field(default=1 << 20, ge=1024, le=1 << 30)
    """Most bytes kept of the agent's stdout and stderr (and the largest file it may write:
    RLIMIT_FSIZE)."""
    max_concurrent: int = Field(default=0, ge=0, le=4096)
    """Most agent processes of one worker (or one evaluation) running at once; the others wait
    (their wall-clock bound starts when they run). 0 = twice the CPUs."""
    failed_exit_is_failure: bool = True
    """An agent that exits non-zero ends its episode as a failure (re-run, never a reward).
    False: its calls are scored like those of an agent that exited 0."""

    @field_validator("result_file")
    @classmethod
    def _relative(cls, v: str) -> str:
        if v.startswith("/") or ".." in v.split("/"):
            raise ValueError("agent.result_file must be a path inside the agent's work directory")
        return v
