"""`[eval]`: held-out evaluation."""

from pydantic import Field

from slipstream.config.base import Section


class EvalConfig(Section):
    num_prompts: int = Field(default=200, ge=1)
    """Held-out prompts to evaluate (at most task.num_heldout)."""
    k: int = Field(default=8, ge=1)
    """Samples per prompt for pass@k."""
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature for pass@k (pass@1 is greedy)."""
    max_new_tokens: int = Field(default=32, ge=1)
    """Completion length cap."""
