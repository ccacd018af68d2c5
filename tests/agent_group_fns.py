"""A group reward function over agent episodes (tests/unit/test_agent_rewards.py; tests/ is on
the path, and the spawned reward processes inherit it). TRL's signature, `group = true`."""


def claim_above_group_low(prompts, completions, agent_output, messages, **columns):
    """Each member's claimed answer (`agent_output["answer"]`) minus the lowest claim of its
    group; -1.0 for a member whose `messages` are not its 4-message conversation."""
    claims = [o["answer"] for o in agent_output]
    low = min(claims)
    return [
        float(c - low) if m is not None and len(m) == 4 else -1.0
        for c, m in zip(claims, messages, strict=True)
    ]
