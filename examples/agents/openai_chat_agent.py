"""A minimal agent written only against the `openai` SDK: the task's prompt as one user
message, then (optionally) a second turn that appends the reply and asks again. It prints its
answer as JSON. Runs under `task.env = "agent"` (docs/agents.md):

    [agent]
    command = "{python} examples/agents/openai_chat_agent.py"

Environment knobs (for tests and experiments): AGENT_TURNS (default 1), AGENT_STREAM=1 (stream
the replies), AGENT_REWRITE=1 (the second turn drops the first reply: a history rewrite).
"""

import json
import os
import sys

from openai import OpenAI

task = json.load(sys.stdin)
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the episode
model = os.environ["OPENAI_MODEL"]
turns = int(os.environ.get("AGENT_TURNS", "1"))
stream = os.environ.get("AGENT_STREAM") == "1"
messages = [{"role": "user", "content": task["prompt"]}]
reply = ""
for _ in range(turns):
    if stream:
        chunks = client.chat.completions.create(model=model, messages=messages, stream=True)
        reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        out = client.chat.completions.create(model=model, messages=messages)
        reply = out.choices[0].message.content or ""
    if os.environ.get("AGENT_REWRITE") == "1":
        messages = [{"role": "user", "content": task["prompt"] + " "}]
    else:
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "="}]
print(json.dumps({"answer": reply, "turns": turns}))
