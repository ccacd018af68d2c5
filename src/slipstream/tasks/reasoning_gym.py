"""`task.name = "reasoning_gym"`: a weighted mix of reasoning-gym's procedural tasks.

    [task]
    name = "reasoning_gym"
    [[task.gym]]
    name = "basic_arithmetic"
    weight = 2.0
    options = {min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 1}

Each `[[task.gym]]` entry is `reasoning_gym.create_dataset(name, seed=task.seed, **options)`. A
problem is drawn as the base class draws (`GeneratedTaskSet`: a per-index seeded RNG picks the
dataset by weight and an item index), its key is `name|question`, and the keyed-hash split keeps
train and held-out disjoint by question. The prompt is the item's `question`, the SFT target its
`answer`, and the verifier is the dataset's own `score_answer(completion, entry)` (the entry is
regenerated from (dataset, index), so `meta` stays small and JSON). reasoning-gym's scores may be
partial (e.g. len(answer)/len(completion) when the answer is contained): they are in [0, 1].

`meta` follows the dataset task's shape for reward functions: `prompt`, `answer`, `columns`
(`answer`, `gym`, `index`).

Not covered: reasoning-gym's curricula and composite datasets' own weighting (use [[task.gym]]).
"""

from __future__ import annotations

import functools
import random
from typing import TYPE_CHECKING, Any

from slipstream.config.base import ConfigError
from slipstream.tasks.base import GeneratedTaskSet, Task, Verdict, keyed_uniform

if TYPE_CHECKING:
    from slipstream.config.task import TaskConfig
    from slipstream.model.tokenizer import Tokenizer

# Item indices drawn per dataset (reasoning-gym items are a function of seed + index).
INDEX_SPACE = 2**31 - 1


class ReasoningGymTaskSet(GeneratedTaskSet):
    name = "reasoning_gym"

    def __init__(self, cfg: TaskConfig, tokenizer: Tokenizer) -> None:
        super().__init__(cfg, tokenizer)
        try:
            import reasoning_gym
        except ModuleNotFoundError as e:
            raise ConfigError(
                "task.name = 'reasoning_gym' needs the reasoning-gym package: "
                "pip install 'slipstream[data]'"
            ) from e
        self.datasets: dict[str, Any] = {}
        for k, g in enumerate(cfg.gym):
            if g.name in self.datasets:
                raise ConfigError(f"task.gym[{k}].name = {g.name!r} appears twice")
            try:
                self.datasets[g.name] = reasoning_gym.create_dataset(
                    g.name, seed=cfg.seed, size=INDEX_SPACE, **g.options
                )
            except (ValueError, TypeError, AssertionError, KeyError) as e:
                raise ConfigError(f"task.gym[{k}] ({g.name!r}): {str(e).splitlines()[0]}") from None
        self.names = [g.name for g in cfg.gym]
        self.weights = [g.weight for g in cfg.gym]

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (one task set per job; bounded)
    def entry(self, name: str, index: int) -> dict[str, Any]:
        return self.datasets[name][index]

    def generate(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        name = rng.choices(self.names, self.weights)[0]
        index = rng.randrange(INDEX_SPACE)
        entry = self.entry(name, index)
        question, answer = str(entry["question"]), str(entry["answer"])
        meta = {
            "gym": name,
            "index": index,
            "prompt": question,
            "answer": answer,
            "columns": {"answer": answer, "gym": name, "index": index},
        }
        return f"{name}|{question}", question, meta

    def verify(self, task: Task, completion: str) -> Verdict:
        name, index = task.meta["gym"], task.meta["index"]
        try:
            score = float(
                self.datasets[name].score_answer(completion.strip(), self.entry(name, index))
            )
        except Exception as e:  # noqa: BLE001 (a task's own scorer must never fail the worker)
            return Verdict(0.0, f"{name}: score_answer raised {type(e).__name__}")
        if not 0.0 <= score <= 1.0:  # NaN included
            return Verdict(0.0, f"{name}: score_answer returned {score}")
        return Verdict(score, "correct" if score == 1.0 else f"{name}: score {score:.2f}")

    def reference(self, task: Task) -> str:
        return task.meta["answer"]

    def demonstration(self, task: Task) -> str:
        """The dataset's answer, or (task.demo_reversed) the answer written backwards for a keyed
        share of the problems whose answer does not read the same both ways."""
        answer = self.reference(task)
        rate = self.cfg.demo_reversed
        if rate > 0 and answer != answer[::-1]:
            if keyed_uniform(self.cfg.seed, "gym-teacher", task.key) < rate:
                return answer[::-1]
        return answer


def make_taskset(cfg: TaskConfig, tokenizer: Tokenizer) -> ReasoningGymTaskSet:
    return ReasoningGymTaskSet(cfg, tokenizer)
