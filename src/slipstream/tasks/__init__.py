"""Built-in verifiable tasks. See `slipstream.tasks.base` for the interface (`get_taskset`,
`TaskSet`, `Task`, `Verdict`); task modules (arithmetic, countdown, code) load on demand."""

from slipstream.tasks.base import (
    GeneratedTaskSet,
    SandboxedTaskSet,
    Task,
    TaskSet,
    Verdict,
    get_taskset,
)

__all__ = ["GeneratedTaskSet", "SandboxedTaskSet", "Task", "TaskSet", "Verdict", "get_taskset"]
