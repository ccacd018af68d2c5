"""A tool-using verifiers 0.4 taskset (the v1 counterpart of a `ToolEnv`): vf_arith's tasks with a
`multiply` tool served over MCP by a `vf.Toolset`; the `null` harness hands the model the tool
and runs its calls. Written only against verifiers. Scored like vf_arith (0.8 * correct +
0.2 * concise) plus 0.1 * `used_tool`.

verifiers starts the tool server as `python -m vf_calc` in its subprocess runtime, so this
folder must be importable there (`PYTHONPATH`; `slipstream.envs.verifiers_env run --path` sets
it).
"""

from __future__ import annotations

import verifiers.v1 as vf
from vf_arith import ArithData, ArithTask, ArithTaskset


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    async def multiply(self, a: int, b: int) -> str:
        """The product a * b."""
        return str(a * b)


class CalcTask(ArithTask):
    @classmethod
    def toolsets(cls, config):
        return [CalcToolset(vf.ToolsetConfig())]

    @vf.reward(weight=0.1)
    async def used_tool(self, task: ArithData, trace: vf.Trace) -> float:
        """1 when the model called a tool before answering."""
        return float(any(m.role == "tool" for m in trace.messages))


class CalcTaskset(vf.Taskset[CalcTask]):
    def load(self):
        for t in ArithTaskset(self.config).load():
            yield CalcTask(t.data, t.config)


__all__ = ["CalcTaskset"]

if __name__ == "__main__":
    CalcToolset.run()
