"""A tool-using agent written only against the `openai` SDK: the policy may call a calculator by
writing `<py>EXPRESSION</py>`; the agent evaluates the arithmetic (+ - * / // % ** and
parentheses, nothing else), sends the result back as `<out>VALUE\n</out>` in the next user
message, and lets the policy answer. At most AGENT_STEPS calls (default 3). It prints
{"answer", "tool_calls", "calls"} as JSON. configs/agent.toml trains the tiny policy with it.

The history it sends back is the conversation so far with each tool call's reply closed by the
`</py>` stop string it was stopped at, so every call's prompt extends the previous call's prompt
and completion: an episode is one token-exact sample (docs/agents.md). SFT demonstrations of a
task set with a tool teacher (tool_arithmetic) follow this same exchange
(envs/agent.py, `AgentEnv.demonstration`).
"""

import ast
import json
import operator
import os
import sys

from openai import OpenAI

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
       ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
       ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}  # fmt: skip


def calculate(expression: str) -> str:
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")

    try:
        return repr(value(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError) as e:
        return f"error: {type(e).__name__}"


task = json.load(sys.stdin)
client = OpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY: the episode's endpoint
model = os.environ.get("OPENAI_MODEL", "policy")
messages = [{"role": "user", "content": task["prompt"]}]
answer, tool_calls, calls = "", 0, 0
for step in range(int(os.environ.get("AGENT_STEPS", "3"))):
    last = step == int(os.environ.get("AGENT_STEPS", "3")) - 1
    out = client.chat.completions.create(model=model, messages=messages,
                                         stop=None if last else ["</py>"])  # fmt: skip
    calls += 1
    text = out.choices[0].message.content or ""
    start = text.rfind("<py>")
    if last or start < 0 or out.choices[0].finish_reason != "stop":
        answer = text
        break
    tool_calls += 1
    result = calculate(text[start + len("<py>") :])
    messages += [{"role": "assistant", "content": text + "</py>"},
                 {"role": "user", "content": f"<out>{result}\n</out>"}]  # fmt: skip
print(json.dumps({"answer": answer, "tool_calls": tool_calls, "calls": calls}))
