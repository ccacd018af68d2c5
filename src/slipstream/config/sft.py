"""`[sft]`: supervised warm start on the task's demonstrations."""

from pydantic import Field

from slipstream.config.base import Section


class SFTConfig(Section):
    steps: int = Field(default=600, ge=0)
    """Optimizer steps."""
    batch_size: int = Field(default=64, ge=1)
    """Sequences per step."""
    lr: float = Field(default=3e-3, gt=0)
    """Peak learning rate (AdamW)."""
    warmup_steps: int = Field(default=30, ge=0)
    """Linear warm-up steps, then cosine decay."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Max global gradient norm."""
