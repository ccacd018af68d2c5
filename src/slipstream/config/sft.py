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
    logits_chunk_tokens: int = Field(default=4096, ge=0, le=1_048_576)
    """Token positions per chunk of the LM head + cross-entropy (model/lm_loss.py): the float32
    (B, T, V) logits are never materialised; 0: the full logits (the reference path)."""
    log_every: int = Field(default=10, ge=1)
    """Write a metrics line (and refresh the progress bar's loss) every this many steps."""
    min_pass_at_1: float = Field(default=0.0, ge=0, le=1)
    """A starting point for RL that does not hang on CPU rounding: after `steps`, while greedy
    pass@1 on the validation prompts is below this, train `extend_steps` more at the final lr
    (at most `max_extend_rounds` times). 0 = off (exactly `steps` steps). The validation prompts
    are held-out tasks the job never reports: task.heldout() after the first eval.num_prompts."""
    extend_steps: int = Field(default=200, ge=1)
    """Steps per extension round (see min_pass_at_1)."""
    max_extend_rounds: int = Field(default=8, ge=0)
    """Most extension rounds; SFT then ends below min_pass_at_1 and says so."""
    val_prompts: int = Field(default=500, ge=1)
    """Validation prompts for min_pass_at_1 (task.num_heldout must cover eval.num_prompts +
    val_prompts)."""
