"""`[eval]`: held-out evaluation."""

from pydantic import Field, model_validator

from slipstream.config.base import Section


class EvalConfig(Section):
    checkpoint: str = ""
    """HF-format checkpoint directory to evaluate; empty means <run.output_dir>/sft/checkpoint."""
    num_prompts: int = Field(default=200, ge=1)
    """Held-out prompts to evaluate (at most task.num_heldout)."""
    k: int = Field(default=8, ge=1, le=2**16)  # = engine.base.MAX_SAMPLES (n per prompt)
    """k of pass@k (sampled)."""
    num_samples: int = Field(default=0, ge=0)
    """Samples per prompt for the unbiased pass@k estimate; 0 means k. Must be >= k."""
    temperature: float = Field(default=1.0, gt=0, le=1e6)  # = engine.base.MAX_TEMPERATURE
    """Sampling temperature for pass@k (pass@1 is greedy)."""
    max_new_tokens: int = Field(default=32, ge=1)
    """Completion length cap."""
    batch_size: int = Field(default=512, ge=1)
    """Most sequences decoded together."""

    @model_validator(mode="after")
    def _enough_samples(self) -> "EvalConfig":
        if self.num_samples and self.num_samples < self.k:
            raise ValueError(f"eval.num_samples ({self.num_samples}) must be >= eval.k ({self.k})")
        return self
