"""The MoE policy model (Qwen3-MoE architecture) and its Hugging Face checkpoint I/O.
Importing this package imports torch."""

from slipstream.config.model import ModelConfig
from slipstream.model.attention import KVCache, causal_attend, sdpa
from slipstream.model.checkpoint import (
    RowReader,
    hf_config_from_model_config,
    hf_from_internal,
    hf_weights,
    load_hf_state_dict,
    load_pretrained,
    model_config_from_hf,
    read_safetensors_dir,
    save_pretrained,
    state_dict_to_hf,
)
from slipstream.model.moe_block import load_balancing_loss, router_z_loss
from slipstream.model.transformer import ModelOutput, MoEForCausalLM, is_moe_layer

ModelArgs = ModelConfig
"""Alias: the model is configured by the `[model]` config section."""

__all__ = [
    "KVCache",
    "ModelArgs",
    "ModelConfig",
    "ModelOutput",
    "MoEForCausalLM",
    "causal_attend",
    "RowReader",
    "hf_config_from_model_config",
    "hf_from_internal",
    "hf_weights",
    "is_moe_layer",
    "load_balancing_loss",
    "load_hf_state_dict",
    "load_pretrained",
    "model_config_from_hf",
    "read_safetensors_dir",
    "router_z_loss",
    "save_pretrained",
    "sdpa",
    "state_dict_to_hf",
]
