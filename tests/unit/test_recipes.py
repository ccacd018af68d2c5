"""docs/recipes.md's configs load and mean what the recipe says (issue 49). The GPU recipe is
written, never run: this checks only that its split of the node is the one the page describes."""

from __future__ import annotations

from pathlib import Path

from slipstream.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_8_gpu_recipe_loads_and_splits_the_node_as_documented() -> None:
    cfg = load_config(str(ROOT / "configs/recipes/hf-moe-8gpu.toml"), [])
    assert cfg.model.init_from == cfg.task.tokenizer == "/models/ckpt"
    assert (cfg.run.device, cfg.trainer.num_processes, cfg.trainer.parallel.ep) == ("cuda", 4, 4)
    assert (cfg.engine.type, cfg.engine.weight_sync, cfg.rollout.num_workers) == (
        "http",
        "store",
        4,
    )
    assert cfg.task.name == "dataset"
    page = (ROOT / "docs/recipes.md").read_text()
    assert "configs/recipes/hf-moe-8gpu.toml" in page and "never run" in page.lower()
