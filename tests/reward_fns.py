"""Reward functions the reward tests configure (`kind = "python"`, `function = "reward_fns:NAME"`;
tests/ is on the path, and the spawned reward processes inherit it). TRL's signature."""

import asyncio
import os
import time


def length_reward(prompts, completions, **columns):
    """1 / (1 + len) of each completion (a real, varying reward)."""
    return [1.0 / (1.0 + len(c if isinstance(c, str) else c[-1]["content"])) for c in completions]


def echo_columns(prompts, completions, **columns):
    """1.0 when every column reached the function as a list of len(completions), else 0."""
    ok = all(isinstance(v, list) and len(v) == len(completions) for v in columns.values())
    return [float(ok)] * len(completions)


def contains_answer(prompts, completions, answer, **columns):
    """TRL's README example shape: the reference appears in the completion."""
    return [
        float(str(a) in (c if isinstance(c, str) else c[-1]["content"]))
        for c, a in zip(completions, answer, strict=True)
    ]


def per_sample(prompt, completion, **columns):
    """batched = false: one value."""
    return float(len(completion) % 2)


async def async_reward(prompts, completions, **columns):
    await asyncio.sleep(0.01)
    return [0.5] * len(completions)


def not_applicable(prompts, completions, **columns):
    return [None] * len(completions)


def rank_in_group(prompts, completions, **columns):
    """group = true: 1 for the shortest completion(s) of the group, else 0."""
    lens = [len(c) for c in completions]
    return [float(n == min(lens)) for n in lens]


def raises(prompts, completions, **columns):
    raise ZeroDivisionError("the user's bug")


def hangs(prompts, completions, **columns):
    time.sleep(3600)


def returns_nan(prompts, completions, **columns):
    return [float("nan")] * len(completions)


def returns_string(prompts, completions, **columns):
    return ["1.0"] * len(completions)


def returns_bool(prompts, completions, **columns):
    return [True] * len(completions)


def wrong_length(prompts, completions, **columns):
    return [1.0] * (len(completions) + 1)


def exits(prompts, completions, **columns):
    os._exit(3)


def allocates(prompts, completions, **columns):
    hog = []
    while True:
        hog.append(bytearray(64 << 20))


def sleeps_1s(prompts, completions, **columns):
    """The bench's slow reward: 1 s per call."""
    time.sleep(1.0)
    return [1.0] * len(completions)


FLAKY_STATE = os.environ.get("SLIPSTREAM_TEST_FLAKY_DIR", "")


def flaky(prompts, completions, **columns):
    """Fails on the first call of each process, then works (a marker file per process)."""
    mark = os.path.join(FLAKY_STATE, f"flaky-{os.getpid()}")
    if not os.path.exists(mark):
        open(mark, "w").close()
        raise RuntimeError("first call fails")
    return [1.0] * len(completions)


def agent_answer(prompts, completions, agent_output, **columns):
    """Agent episodes (tests/unit/test_agent_rewards.py): 1.0 when the agent's own output names
    the reference answer, 0.0 otherwise (no output included)."""
    return [
        float(isinstance(o, dict) and o.get("answer") == a)
        for o, a in zip(agent_output, columns["answer"], strict=True)
    ]


def conversation_length(prompts, completions, messages, **columns):
    """Agent episodes: the number of messages of the final conversation (None without one)."""
    return [None if m is None else float(len(m)) for m in messages]


def last_user_turn(prompts, completions, messages, **columns):
    """Agent episodes: 1.0 when the conversation's last user turn is "sure?" and it ends with
    the assistant's reply, the completion scored."""
    return [
        float(
            m[-2] == {"role": "user", "content": "sure?"}
            and m[-1]["role"] == "assistant"
            and m[-1]["content"] == c
        )
        for m, c in zip(messages, completions, strict=True)
    ]
