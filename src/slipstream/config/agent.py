"""`[agent]`: the user's agent program that `task.env = "agent"` runs once per episode
(docs/agents.md)."""

import re
import shlex
from dataclasses import dataclass

from pydantic import Field, field_validator, model_validator

from slipstream.config.base import Section

# what `/bin/sh -c` would treat as more than words (expansions, redirections, lists, globs,
# comments): a command holding any of them is not a plain `{python} SCRIPT ARGS...` line
_SHELL_SYNTAX = set("|&;<>()$`\\*?[]{}~!#\n")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True)
class PythonCommand:
    """`agent.command` as a Python program a warm template can fork (`agent.preload`): either
    `{python} SCRIPT ARGS...` (`module` None) or `{python} -m MODULE ARGS...` (`script` None).
    `{cwd}` is still a placeholder in `script` and `args`."""

    script: str | None
    module: str | None
    args: tuple[str, ...]


def python_command(command: str) -> PythonCommand:
    """Parse `command` as `{python} SCRIPT ARGS...` or `{python} -m MODULE ARGS...`: words only
    (quotes allowed; no shell syntax: `$`, pipes, redirections, `;`, `&&`, globs, comments), no
    interpreter options but `-m`, `{python}` only as the first word. ValueError otherwise."""
    bare = command.replace("{python}", "").replace("{cwd}", "")
    if bad := sorted(_SHELL_SYNTAX & set(bare)):
        raise ValueError(f"holds shell syntax {''.join(bad)!r}")
    try:
        words = shlex.split(command)
    except ValueError as e:
        raise ValueError(f"does not parse as words: {e}") from None
    if len(words) < 2 or words[0] != "{python}":
        raise ValueError("is not `{python} SCRIPT ARGS...` or `{python} -m MODULE ARGS...`")
    if any("{python}" in w for w in words[1:]):
        raise ValueError("names {python} past its first word")
    if words[1] == "-m":
        if len(words) < 3 or not _MODULE.fullmatch(words[2]):
            raise ValueError("`{python} -m` needs a module name")
        return PythonCommand(None, words[2], tuple(words[3:]))
    if words[1].startswith("-"):
        raise ValueError(f"passes the interpreter option {words[1]!r} (only -m is supported)")
    return PythonCommand(words[1], None, tuple(words[2:]))


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
    preload: list[str] = Field(default_factory=list)
    """Python modules to import once, in a warm template process, instead of once per episode
    (e.g. ["openai", "httpx"]): each episode's agent is then a fork of that template running the
    script (`runpy`), its start-up imports already done. Needs `command` of the form
    `{python} SCRIPT ARGS...` or `{python} -m MODULE ARGS...` (words only, no shell syntax).
    Empty: every episode starts a fresh `/bin/sh -c COMMAND` (docs/agents.md, "Warm start")."""

    sandbox: bool = False
    """Run each episode's agent inside a bwrap sandbox (docs/agents.md, "Sandbox"): its own
    user, mount, pid, network, IPC and UTS namespaces, no capabilities, the seccomp filter of
    sandbox/seccomp.py; it sees /usr (and /bin, /lib*), a minimal /etc, the Python installation
    of `{python}` and `sandbox_binds`, all read-only, its work directory (writable, at /sandbox)
    and a private /tmp; no network: `OPENAI_BASE_URL` (http://127.0.0.1:PORT/v1) reaches its
    episode's endpoint alone, through a forwarder to a Unix socket. Needs bwrap and user
    namespaces (checked when the runtime starts); not with `preload`."""
    sandbox_binds: list[str] = Field(default_factory=list)
    """Host paths a sandboxed agent may read, bound read-only at the same path (`{cwd}` is the
    job's directory), e.g. ["{cwd}/examples/agents"] for the agent's script. Only with
    `sandbox`."""
    sandbox_tmp_mib: int = Field(default=64, ge=1, le=1 << 20)
    """Size of a sandboxed agent's private /tmp (a tmpfs, gone with the run); what it holds
    counts against `sandbox_memory_mib`."""
    sandbox_cgroup: bool = True
    """Put each sandboxed run in a cgroup of its own, as the `bwrap` sandbox backend does
    (memory + swap, pids, CPU quota: `sandbox_memory_mib`, `sandbox_pids_max`, `sandbox_vcpus`),
    killed and removed when the run ends. Needs writable cgroups (root; checked when the
    runtime starts). False: no cgroup, the run's ulimits only (docs/agents.md, "Sandbox")."""
    sandbox_memory_mib: int = Field(default=2048, ge=16, le=1 << 20)  # 1 TiB, as sandbox.memory_mib
    """Memory limit of a sandboxed run's cgroup (memory + swap, /tmp and /dev/shm included): past
    it the kernel OOM-kills a process inside, and a run that then fails is an "oom" failure."""
    sandbox_pids_max: int = Field(default=256, ge=8)
    """Processes and threads of a sandboxed run's cgroup (bwrap and the forwarder included)."""
    sandbox_vcpus: int = Field(default=1, ge=1)
    """CPU quota of a sandboxed run's cgroup, in CPUs."""

    @field_validator("preload")
    @classmethod
    def _modules(cls, v: list[str]) -> list[str]:
        for name in v:
            if not _MODULE.fullmatch(name):
                raise ValueError(f"agent.preload: {name!r} is not a module name (e.g. openai)")
        return v

    @model_validator(mode="after")
    def _preload_needs_python(self) -> "AgentConfig":
        if self.preload:
            try:
                python_command(self.command)
            except ValueError as e:
                raise ValueError(
                    f"agent.preload needs agent.command to be `{{python}} SCRIPT ARGS...` or "
                    f"`{{python}} -m MODULE ARGS...`; {self.command!r} {e}"
                ) from None
        return self

    @model_validator(mode="after")
    def _sandbox_combinations(self) -> "AgentConfig":
        if self.sandbox and self.preload:
            raise ValueError("agent.sandbox = true does not work with agent.preload (the warm "
                             "template runs outside any sandbox); set one of them")  # fmt: skip
        if self.sandbox_binds and not self.sandbox:
            raise ValueError("agent.sandbox_binds is set but agent.sandbox is false")
        for path in self.sandbox_binds:
            if not path.replace("{cwd}", "/").startswith("/"):
                raise ValueError(f"agent.sandbox_binds: {path!r} is not an absolute path "
                                 "(or one starting with {cwd})")  # fmt: skip
        return self

    @field_validator("result_file")
    @classmethod
    def _relative(cls, v: str) -> str:
        if v.startswith("/") or ".." in v.split("/"):
            raise ValueError("agent.result_file must be a path inside the agent's work directory")
        return v
