"""A multi-turn verifiers 0.4 environment (the v1 counterpart of a `MultiTurnEnv` with a custom
`env_response`): the environment answers each wrong reply with a user turn ("no, again:") and
lets the model try again, up to `max_attempts` replies. Written only against verifiers; the
tasks and their weighted rewards are vf_arith's, plus a bonus for getting it on the first try.

The v1 API has no `MultiTurnEnv`: an `Env` subclass drives the conversation through
`agents.agent.interaction(task)`, one `turn()` per user message, which is what `env_response`
was.
"""

from __future__ import annotations

import verifiers.v1 as vf
from vf_arith import ArithData, ArithTask, ArithTaskset


class RetryTask(ArithTask):
    @vf.reward(weight=0.5)
    async def first_try(self, task: ArithData, trace: vf.Trace) -> float:
        """1 when one reply was enough."""
        return float(trace.num_turns == 1 and trace.last_reply.strip() == task.answer)


class RetryTaskset(vf.Taskset[RetryTask]):
    def load(self):
        for t in ArithTaskset(self.config).load():
            yield RetryTask(t.data, t.config)


class RetryEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    max_attempts: int = 2
    """Most replies the model gets (the first and the retries)."""
    retry_message: str = "no, again:"


class RetryEnv(vf.Env[RetryEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            reply = await chat.turn()  # the task's prompt opens the conversation
            for _ in range(self.config.max_attempts - 1):
                if reply.terminated or reply.last_reply.strip() == task.data.answer:
                    break
                reply = await chat.turn(self.config.retry_message)


__all__ = ["RetryEnv", "RetryTaskset"]
