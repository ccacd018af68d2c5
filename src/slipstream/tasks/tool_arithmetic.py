"""`tool_arithmetic`: the arithmetic task (same prompts, verifier and options) whose SFT teacher
sometimes computes the answer with the `<py>` tool of the `python_tool` environment.

    347*286=<py>347*286</py><out>99242
    </out>99242                                  # the teacher uses the tool (demo_tool_use)
    347*286=99242                                # the teacher answers in its head

Both demonstrations are correct; the imperfection is that the teacher reaches for the tool only
when the numbers look big: always when the first operand's leading digit is at least
`task.demo_tool_min_lead`, otherwise on a keyed share `task.demo_tool_use` of the problems. A
student that imitates it answers most problems in its head (and explores the tool on them at
about that share). A tiny policy cannot multiply 3-4 digit numbers in its head, but it can
copy the operands into a program and the program's output into its answer: reinforcement
learning against the exact verifier then has to raise tool use to raise pass@1.

The splits are keyed by this task's name, so its held-out problems differ from `arithmetic`'s.
Not covered: a teacher whose programs are wrong (they are always the prompt's expression).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slipstream.tasks.arithmetic import ArithmeticTaskSet
from slipstream.tasks.base import Task, keyed_uniform

if TYPE_CHECKING:
    from slipstream.config.task import TaskConfig
    from slipstream.model.tokenizer import Tokenizer


class ToolArithmeticTaskSet(ArithmeticTaskSet):
    name = "tool_arithmetic"

    def uses_tool(self, task: Task) -> bool:
        """Whether the teacher's demonstration of `task` uses the tool: the first operand's
        leading digit is >= demo_tool_min_lead, or the problem is in the keyed share
        demo_tool_use of the others."""
        if int(str(task.meta["a"])[0]) >= self.cfg.demo_tool_min_lead:
            return True
        return keyed_uniform(self.cfg.seed, "tool-teacher", task.key) < self.cfg.demo_tool_use

    def tool_demonstration(self, task: Task) -> tuple[str, str] | None:
        """(program, its stdout) when the teacher uses the tool on `task`, else None: the
        program is the prompt's expression (`347*286`, a notebook cell whose value the tool
        prints), the stdout the exact answer and a newline, known here without running
        anything."""
        if not self.uses_tool(task):
            return None
        expression = task.prompt.removesuffix("=")
        return expression, f"{task.meta['answer']}\n"


def make_taskset(cfg: TaskConfig, tokenizer: Tokenizer) -> ToolArithmeticTaskSet:
    return ToolArithmeticTaskSet(cfg, tokenizer)
