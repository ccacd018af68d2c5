"""Hugging Face tooling on an exported checkpoint: `slipstream sft` -> a published weight version
-> `slipstream ckpt export` -> transformers `AutoTokenizer` + `AutoModelForCausalLM` with no BOS
or EOS handling by the caller (`tok(prompt)`, `model.generate(...)`, `tok.decode(...,
skip_special_tokens=True)`) give, prompt for prompt, the greedy completions `slipstream eval`
decodes on the held-out set, hence the same pass@1. Tiny config: a few seconds of SFT."""

from __future__ import annotations

import json

import pytest
import torch

from jobutil import TINY_SFT
from slipstream.cli import main
from slipstream.config import QUICKSTART, load_config
from slipstream.model import hf_weights, load_pretrained
from slipstream.storage import open_stores
from slipstream.tasks import get_taskset

transformers = pytest.importorskip("transformers")

TINY = [*TINY_SFT, "--eval.k=1", "--eval.num_samples=1", "--eval.max_new_tokens=6"]


def test_transformers_on_the_export_reproduce_slipstream_eval(tmp_path) -> None:
    out = tmp_path / "run"
    args = [f"--run.output_dir={out}", *TINY]
    assert main(["sft", *args, "--sft.steps=60"]) == 0
    cfg = load_config(str(QUICKSTART), [a.removeprefix("--") for a in args])  # as the CLI
    state, config = hf_weights(load_pretrained(str(out / "sft" / "checkpoint")))
    open_stores(cfg).weights.publish(0, state, config)
    export = tmp_path / "export"
    assert main(["ckpt", "export", *args, str(export)]) == 0
    assert main(["eval", *args, "--checkpoint", str(export)]) == 0
    result = json.loads((out / "eval" / "results.json").read_text())

    tok = transformers.AutoTokenizer.from_pretrained(str(export))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    model.eval()
    tasks = get_taskset(cfg.task).heldout()[: cfg.eval.num_prompts]
    correct = 0.0
    for task, sample in zip(tasks, result["samples"], strict=True):
        assert sample["prompt"] == task.prompt
        enc = tok(task.prompt, return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=cfg.eval.max_new_tokens, do_sample=False)
        text = tok.decode(gen[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        assert text == sample["greedy"], task.prompt
        correct += get_taskset(cfg.task).verify(task, text).reward
    assert correct / len(tasks) == result["report"]["pass_at_1_greedy"]
