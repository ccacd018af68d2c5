"""The reward model: our MoE backbone with a scalar head, saved and loaded as transformers'
`Qwen3MoeForSequenceClassification` (num_labels = 1).

Shape legend: B batch, T tokens, D hidden_size.

    rm = MoERewardModel.from_policy(policy)            # backbone copied, fresh head
    rewards_B = rm.score(input_ids_BT, lengths_B)      # float32, one scalar per sequence
    save_reward_model(rm, "rm/checkpoint", tokenizer)  # config.json + safetensors + tokenizer
    rm = load_reward_model("rm/checkpoint")

Why a subclass of the causal LM: a sequence-classification model is the causal LM with its
(D, V) head replaced by a (D, 1) head (`score.weight` in HF naming) read at the last real token,
exactly what transformers' `GenericForSequenceClassification` does. Keeping the one forward
(packing, routing, router losses) means no second copy of the decoder loop. The per-position
"logits" of that forward are per-position scores; `score` picks each row's last real token.

The scored sequence of a text is `tokenizer.encode_prompt(text)` (BOS + text, what
`AutoTokenizer(text).input_ids` gives for the saved tokenizer): training, the server and
transformers all see the same ids. config.json sets `pad_token_id` to the tokenizer's pad id, so
transformers finds the last real token of right-padded batches the same way we do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from slipstream.config.model import ModelConfig
from slipstream.model.checkpoint import (
    SINGLE_FILE,
    hf_config_from_model_config,
    hf_from_internal,
    load_hf_state_dict,
    model_config_from_hf,
    read_safetensors_dir,
)
from slipstream.model.tokenizer import Tokenizer
from slipstream.model.transformer import MoEForCausalLM

ARCHITECTURE = "Qwen3MoeForSequenceClassification"
HEAD_HF = "score.weight"
HEAD_INTERNAL = "lm_head.weight"
SUMMARY_FILE = "rm_summary.json"
"""Written last by `save_reward_model`: `rm train`'s figures; its presence marks a complete
checkpoint."""


class MoERewardModel(MoEForCausalLM):
    """Qwen3-MoE with a scalar head. `forward` returns per-position scores as `logits_BTV`
    (B, T, 1); `score` reads them at each row's last real token."""

    def __init__(self, cfg: ModelConfig) -> None:
        # the head is no longer the embedding's transpose: never tie
        super().__init__(cfg.model_copy(update={"tie_word_embeddings": False}))
        self.lm_head = nn.Linear(cfg.hidden_size, 1, bias=False)
        if self.lm_head.weight.device.type != "meta":
            with torch.no_grad():
                self.lm_head.weight.normal_(0.0, cfg.initializer_range)

    def tie_weights(self) -> None:
        """Never tied (the head is (1, D), the embedding (V, D))."""

    @classmethod
    def from_policy(cls, policy: MoEForCausalLM) -> MoERewardModel:
        """A reward model whose backbone starts as a copy of `policy`'s (the usual RM init: the
        SFT model); the scalar head is freshly initialised."""
        rm = cls(policy.config)
        backbone = {k: v for k, v in policy.state_dict().items() if k.startswith("model.")}
        rm.load_state_dict({**backbone, HEAD_INTERNAL: rm.lm_head.weight.detach()}, strict=True)
        return rm.to(next(policy.parameters()).device)

    def score(self, input_ids_BT: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
        """Reward of each right-padded row: the head at its last real token (float32, (B,))."""
        return self.score_with_aux(input_ids_BT, lengths_B)[0]

    def score_with_aux(
        self, input_ids_BT: torch.Tensor, lengths_B: torch.Tensor, skip_padding: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rewards (B,), the backbone's weighted router aux loss) for training; `skip_padding`
        runs the per-token layers on the real tokens only."""
        B, T = input_ids_BT.shape
        lengths_B = lengths_B.to(input_ids_BT.device)
        if bool((lengths_B < 1).any()) or bool((lengths_B > T).any()):
            raise ValueError(f"lengths must be in [1, {T}], got {lengths_B.tolist()}")
        mask_BT = None
        if skip_padding:
            mask_BT = torch.arange(T, device=input_ids_BT.device)[None] < lengths_B[:, None]
        out = self(input_ids_BT, skip_padding_BT=mask_BT, token_mask_BT=mask_BT)
        rows = torch.arange(B, device=input_ids_BT.device)
        return out.logits_BTV[rows, lengths_B - 1, 0], out.aux_loss


def pad_batch(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) ids and (B,) lengths of token sequences."""
    if not seqs or any(not s for s in seqs):
        raise ValueError("every scored sequence needs at least one token")
    T = max(len(s) for s in seqs)
    ids_BT = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids_BT[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return ids_BT, torch.tensor([len(s) for s in seqs], dtype=torch.long)


@torch.inference_mode()
def score_ids(
    rm: MoERewardModel, seqs: list[list[int]], pad_id: int, max_batch: int = 64
) -> list[float]:
    """Rewards of token sequences, in order (batches of at most `max_batch`, sorted by length so
    a batch pads little)."""
    device = next(rm.parameters()).device
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out = [0.0] * len(seqs)
    for lo in range(0, len(order), max_batch):
        idx = order[lo : lo + max_batch]
        ids_BT, lengths_B = pad_batch([seqs[i] for i in idx], pad_id)
        rewards = rm.score(ids_BT.to(device), lengths_B.to(device)).tolist()
        for i, r in zip(idx, rewards, strict=True):
            out[i] = float(r)
    return out


def hf_config(rm: MoERewardModel, pad_id: int, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of a reward model: Qwen3-MoE plus num_labels = 1 and the pad id."""
    cfg = hf_config_from_model_config(rm.config, dtype)
    cfg.update(
        architectures=[ARCHITECTURE],
        num_labels=1,
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
        problem_type="regression",
        pad_token_id=pad_id,
        tie_word_embeddings=False,
    )
    return cfg


def save_reward_model(
    rm: MoERewardModel,
    directory: str | Path,
    tokenizer: Tokenizer,
    extra: dict[str, Any] | None = None,
) -> Path:
    """config.json + model.safetensors (HF names, `score.weight` head, per-expert layout) +
    the tokenizer's files, and `extra` as rm_summary.json (written last: its presence marks a
    complete checkpoint). Returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = next(rm.parameters()).dtype
    sd = {k: v.detach() for k, v in rm.state_dict().items()}
    sd[HEAD_HF] = sd.pop(HEAD_INTERNAL)
    hf = hf_from_internal(sd, rm.config)
    hf = {k: v.to("cpu").contiguous().clone() for k, v in hf.items()}
    (directory / "config.json").write_text(json.dumps(hf_config(rm, tokenizer.pad_id, dtype),
                                                      indent=2) + "\n")  # fmt: skip
    save_file(hf, str(directory / SINGLE_FILE), metadata={"format": "pt"})
    tokenizer.save(directory)
    (directory / SUMMARY_FILE).write_text(json.dumps(extra or {}, indent=2) + "\n")
    return directory


def is_reward_checkpoint(directory: str | Path) -> bool:
    """Whether `directory`'s config.json is a sequence-classification (reward) model."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return False
    arch = json.loads(path.read_text()).get("architectures") or []
    return any(a.endswith("ForSequenceClassification") for a in arch)


def load_reward_model(
    directory: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> MoERewardModel:
    """A reward model from an HF sequence-classification directory (ours, or any Qwen3-MoE /
    dense Qwen3 `*ForSequenceClassification` with num_labels = 1). Eval mode."""
    directory = Path(directory)
    hf = json.loads((directory / "config.json").read_text())
    labels = hf.get("num_labels", len(hf.get("id2label") or {}) or 2)
    if labels != 1:
        raise ValueError(f"{directory}: num_labels={labels}; a reward model has one scalar output")
    cfg = model_config_from_hf(hf)
    sd = read_safetensors_dir(directory, device=device, dtype=dtype)
    if HEAD_HF not in sd:
        raise ValueError(f"{directory}: no {HEAD_HF} (not a sequence-classification checkpoint)")
    sd[HEAD_INTERNAL] = sd.pop(HEAD_HF)
    with torch.device("meta"):
        rm = MoERewardModel(cfg)
    load_hf_state_dict(rm, sd)
    return rm.eval()
