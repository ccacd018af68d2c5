"""`slipstream bench peer`: the peer baseline in the project. TRL's `GRPOTrainer` (the dev extra)
trains the same SFT start on the same task with the same budget and recipe as `slipstream run`,
and slipstream's own evaluator scores it, so a claim against the peer is one command away.

What is the same as `slipstream run -c CONFIG --model.init_from=INIT`:
- the start (INIT, an HF-format checkpoint such as runs/quickstart/sft/checkpoint, loaded by
  transformers with the task's tokenizer) and the train split of [task];
- the batch: trainer.groups_per_step groups x rollout.group_size samples per optimizer step,
  rollout.max_new_tokens, rollout.temperature; trainer.steps steps (or --steps);
- the loss and optimizer: GRPO with group std normalisation (trainer.std_norm), clip
  trainer.clip_low / clip_high, token-mean (TRL's "dapo") or sequence-mean ("grpo") aggregation,
  KL weight trainer.kl_coef, AdamW at trainer.lr with beta2 trainer.adam_beta2 and weight decay
  trainer.weight_decay, trainer.warmup_steps of linear warm-up then cosine to lr *
  trainer.min_lr_ratio (or constant), gradient clip trainer.grad_clip, the MoE routers frozen
  when trainer.freeze_router;
- threads: run.num_threads; seed: run.seed;
- the score: held-out greedy pass@1 on eval.num_prompts prompts by `slipstream.evaluate`, every
  --eval-every steps (default trainer.eval_every) and at the end, on the policy converted back
  to slipstream's model.
What differs, by TRL's design: generation is synchronous and on-policy (HF `generate`, one
batch, then one step), no staleness, no truncated importance weights.

Output in --output (default <run.output_dir>/peer): policy/ (the trained policy, HF format),
metrics.jsonl with the same evaluation records as a `slipstream run` (step, elapsed_s, eval_s,
pass_at_1; an end record with pass_at_1_before and wall_s), so `scripts/quickstart-summary.py
--curve` puts peer and slipstream runs in one table; peer.json with the curve, samples/s and
provenance (TRL and transformers versions, CPU, load).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from slipstream.config.args import add_config_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "peer",
        help="TRL's GRPOTrainer from the same SFT start, same budget, scored by slipstream",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    p.add_argument("--init", required=True, metavar="DIR",
                   help="the SFT start: an HF-format checkpoint (runs/quickstart/sft/checkpoint)")  # fmt: skip
    p.add_argument(
        "--steps", type=int, default=None, help="optimizer steps (default trainer.steps)"
    )
    p.add_argument("--eval-every", type=int, default=None,
                   help="held-out evaluation every N steps (default trainer.eval_every; 0 = end only)")  # fmt: skip
    p.add_argument("--output", default=None, metavar="DIR",
                   help="run directory (default <run.output_dir>/peer)")  # fmt: skip
    p.set_defaults(func=run)


def grpo_config_kwargs(cfg: Any, steps: int) -> dict[str, Any]:
    """TRL GRPOConfig arguments for the recipe of slipstream's [trainer] and [rollout]."""
    tc, rc = cfg.trainer, cfg.rollout  # trainer.loss is "grpo" (run() refuses the others)
    schedule: dict[str, Any] = (
        {"lr_scheduler_type": "cosine_with_min_lr",
         "lr_scheduler_kwargs": {"min_lr_rate": tc.min_lr_ratio}}
        if tc.lr_schedule == "cosine" else {"lr_scheduler_type": "constant_with_warmup"}
    )  # fmt: skip
    return {
        "per_device_train_batch_size": tc.groups_per_step * rc.group_size,
        "num_generations": rc.group_size,
        "steps_per_generation": 1,  # one batch generated, one optimizer step on it
        "num_iterations": 1,
        "max_completion_length": rc.max_new_tokens,
        "temperature": rc.temperature,
        "learning_rate": tc.lr,
        "warmup_steps": tc.warmup_steps,
        **schedule,
        "max_steps": steps,
        "beta": tc.kl_coef,
        "epsilon": tc.clip_low,
        "epsilon_high": tc.clip_high,
        "loss_type": "dapo" if tc.aggregation == "token_mean" else "grpo",
        "scale_rewards": "group" if tc.std_norm else "none",
        "max_grad_norm": tc.grad_clip,
        "adam_beta2": tc.adam_beta2,
        "weight_decay": tc.weight_decay,
        "seed": cfg.run.seed,
        "use_cpu": cfg.run.device != "cuda",
        "bf16": False,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 50,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def run(args: argparse.Namespace) -> int:
    missing = [
        m for m in ("trl", "transformers", "datasets") if importlib.util.find_spec(m) is None
    ]
    if missing:
        print(f"slipstream bench peer: needs {', '.join(missing)} (pip install -e '.[dev]')",
              file=sys.stderr)  # fmt: skip
        return 2
    init = Path(args.init)
    if not (init / "config.json").is_file():
        print(f"slipstream bench peer: --init {init}: no config.json there (an HF-format "
              "checkpoint, e.g. runs/quickstart/sft/checkpoint)", file=sys.stderr)  # fmt: skip
        return 2

    import torch
    import transformers
    import trl
    from datasets import Dataset

    from slipstream.config import load_config
    from slipstream.evaluate import heldout_pass_at_1
    from slipstream.model import load_pretrained
    from slipstream.observe.metrics import MetricsWriter
    from slipstream.observe.provenance import collect_provenance, write_result
    from slipstream.runtime import setup_torch
    from slipstream.tasks import get_taskset

    # transformers' per-save progress bars and deprecation warnings (TRL's own arguments) would
    # bury the peer's progress lines
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    cfg = load_config(args.config, args.overrides)
    steps = cfg.trainer.steps if args.steps is None else args.steps
    eval_every = cfg.trainer.eval_every if args.eval_every is None else args.eval_every
    if cfg.trainer.loss != "grpo":
        print(f"slipstream bench peer: trainer.loss = {cfg.trainer.loss!r}: the peer baseline "
              "is TRL's GRPO only", file=sys.stderr)  # fmt: skip
        return 2
    if steps < 1 or eval_every < 0:
        print(f"slipstream bench peer: --steps {steps} must be >= 1 and --eval-every "
              f"{eval_every} >= 0", file=sys.stderr)  # fmt: skip
        return 2
    out = Path(args.output or Path(cfg.run.output_dir) / "peer")
    out.mkdir(parents=True, exist_ok=True)
    setup_torch(cfg.run)
    taskset = get_taskset(cfg.task)
    # The start as transformers loads it: the checkpoint plus the task's tokenizer (the one the
    # SFT encoded with; `slipstream ckpt export` adds it the same way).
    start = out / "start"
    shutil.rmtree(start, ignore_errors=True)
    shutil.copytree(init, start)
    taskset.tokenizer.save(start)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(start))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(start), dtype=torch.float32)
    if cfg.trainer.freeze_router:
        frozen = [n for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
        if not frozen:
            raise RuntimeError("trainer.freeze_router: no mlp.gate.weight in the HF model")
        for n, p in model.named_parameters():
            if n in frozen:
                p.requires_grad_(False)

    train = [taskset.train(i) for i in range(taskset.num_train)]
    dataset = Dataset.from_list(
        [{"prompt": t.prompt, "task_index": i} for i, t in enumerate(train)]
    )

    def reward(prompts: list[str], completions: list[str], task_index: list[int], **_: Any):
        return [
            taskset.verify(train[i], c).reward for i, c in zip(task_index, completions, strict=True)
        ]

    def score(hf_model: Any) -> float:
        """Held-out greedy pass@1 of the TRL policy by slipstream's evaluator."""
        with tempfile.TemporaryDirectory(prefix="peer-eval-") as tmp:
            hf_model.save_pretrained(tmp, safe_serialization=True)
            return heldout_pass_at_1(load_pretrained(tmp), taskset, cfg)

    metrics = MetricsWriter(out / "metrics.jsonl")
    records: list[dict[str, Any]] = []
    pass_before = score(model)
    clock: dict[str, float] = {}
    curve: list[dict[str, float]] = []

    class Evaluate(transformers.TrainerCallback):
        def on_train_begin(self, args_, state, control, **kw):  # noqa: ANN001
            clock["t0"] = time.monotonic()

        def on_step_end(self, args_, state, control, model=None, **kw):  # noqa: ANN001
            step = state.global_step
            if not (eval_every and step % eval_every == 0) and step != steps:
                return
            t_eval = time.monotonic()
            rec = {"step": step, "pass_at_1": score(model), "evaluated": True,
                   "samples_total": step * cfg.trainer.groups_per_step * cfg.rollout.group_size}  # fmt: skip
            rec["eval_s"] = time.monotonic() - t_eval
            rec["elapsed_s"] = time.monotonic() - clock["t0"]
            clock["eval_total_s"] = clock.get("eval_total_s", 0.0) + rec["eval_s"]
            # peer.json's curve: training seconds without the evaluations (not a metrics.jsonl
            # key: there train_s is a step's training time)
            curve.append({"step": step, "train_s": rec["elapsed_s"] - clock["eval_total_s"],
                          "pass_at_1": rec["pass_at_1"]})  # fmt: skip
            metrics.log(**rec)
            records.append(rec)
            print(f"peer step {step}/{steps}: held-out pass@1 {rec['pass_at_1']:.1%} "
                  f"({rec['elapsed_s']:.0f} s)", flush=True)  # fmt: skip

    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=trl.GRPOConfig(output_dir=str(out / "trl"), **grpo_config_kwargs(cfg, steps)),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Evaluate()],
    )
    trainer.train()
    wall_s = time.monotonic() - clock["t0"]
    # the trained policy, loadable by `slipstream eval --checkpoint` / `serve --model` / transformers
    trainer.model.save_pretrained(str(out / "policy"), safe_serialization=True)
    taskset.tokenizer.save(out / "policy")
    eval_total_s = clock.get("eval_total_s", 0.0)
    after = records[-1]["pass_at_1"]
    metrics.log(
        event="end", pass_at_1=after, pass_at_1_before=pass_before, wall_s=wall_s, step=steps
    )
    metrics.close()
    samples = steps * cfg.trainer.groups_per_step * cfg.rollout.group_size
    record = {
        "benchmark": "peer",
        "figure": {"name": "TRL GRPOTrainer: held-out greedy pass@1 after", "value": after},
        "baseline": {"name": "the SFT start", "value": pass_before},
        "steps": steps, "samples": samples, "wall_s": wall_s, "eval_s": eval_total_s,
        "samples_per_s": samples / max(wall_s - eval_total_s, 1e-9),
        "curve": [{"step": 0, "train_s": 0.0, "pass_at_1": pass_before}]
        + curve,
        "init": str(init), "config": json.loads(cfg.model_dump_json())["trainer"],
        "provenance": collect_provenance({"trl": trl.__version__,
                                         "transformers": transformers.__version__,
                                         "torch_threads": torch.get_num_threads()}),
    }  # fmt: skip
    path = write_result(out / "peer.json", record)
    print(f"peer: {pass_before:.1%} -> {after:.1%} held-out pass@1 in {steps} steps, "
          f"{wall_s - eval_total_s:.0f} s of training ({record['samples_per_s']:.0f} samples/s), "
          f"{path}")  # fmt: skip
    return 0
