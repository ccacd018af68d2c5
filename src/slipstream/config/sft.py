"""`[sft]`: supervised warm start on the task's demonstrations."""

from pydantic import Field

from slipstream.config.base import Section


class SFTConfig(Section):
    steps: int = Field(default=1200, ge=0)
    """Optimizer steps (0 saves the initial model as the checkpoint)."""
    batch_size: int = Field(default=64, ge=1)
    """Sequences per step (step s trains on train tasks s*batch_size ... (s+1)*batch_size-1)."""
    lr: float = Field(default=3e-3, gt=0)
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    """The cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = Field(default=30, ge=0)
    """Linear warm-up steps, then cosine decay."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Max global gradient norm."""
    log_every: int = Field(default=10, ge=1)
    """Write a metrics line (and refresh the progress bar's loss) every this many steps."""
