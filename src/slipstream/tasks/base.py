"""The task interface every consumer (SFT, eval, the RL loop) uses.

    from slipstream.tasks import get_taskset
    ts = get_taskset(cfg.task)            # TaskSet for cfg.task.name, seeded by cfg.task.seed
    task = ts.train(i)                    # i-th training task (deterministic; i wraps at num_train)
    batch = ts.train_batch(start, n)      # ts.train(start), ..., ts.train(start + n - 1)
    evalset = ts.heldout()                # cfg.task.num_heldout tasks, disjoint from every train task
    ids = ts.prompt_ids(task)             # [bos] + tokens(task.prompt): what the policy is fed
    reward, reason = ts.verify(task, completion_text)   # reward in [0, 1]; never raises on output
    text = ts.demonstration(task)         # a correct completion (SFT target), without EOS
    ts.tokenizer                          # the Tokenizer prompts are encoded with

A `Task` is plain data (id, prompt, JSON-serialisable `meta` with the answer) so queues can snapshot
it (`to_dict` / `Task.from_dict`). The completion passed to `verify` is the decoded text the model
generated after the prompt, up to (not including) EOS.

Splits: every generated problem has a canonical `key`; a keyed hash of (task seed, key) puts a fixed
fraction `heldout_fraction` of the key space in the held-out split. Train tasks are drawn with
rejection of held-out keys, held-out tasks with rejection of train keys, so the splits are disjoint
by construction, for any number of tasks, and both are deterministic for a seed. Train tasks may
repeat (they are samples of an open-ended distribution); held-out tasks are distinct.

Adding a task: a module `slipstream.tasks.<name>` exposing `make_taskset(cfg: TaskConfig,
tokenizer: Tokenizer) -> TaskSet`; generator tasks subclass `GeneratedTaskSet`, tasks with a fixed
problem list override `train`/`heldout` directly.
"""

from __future__ import annotations

import hashlib
import importlib
import random
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from slipstream.config.task import TaskConfig
    from slipstream.model.tokenizer import Tokenizer
    from slipstream.sandbox.base import Sandbox

# Task names served by modules other than `slipstream.tasks.<name>` (none yet).
_MODULES: dict[str, str] = {}
# Attempts per generated task before a split is declared too small for the request.
MAX_DRAWS = 10_000


def keyed_uniform(*parts: object) -> float:
    """A uniform number in [0, 1) that is a fixed function of `parts` (a keyed hash, so splits
    and other per-problem choices are deterministic for a seed, on any machine)."""
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class Verdict(NamedTuple):
    reward: float
    """In [0, 1]."""
    reason: str
    """Short explanation ("correct", "wrong answer: got 12, expected 13", "division by zero", ...)."""


@dataclass(frozen=True)
class Task:
    task_id: str
    """Unique within a TaskSet: "<name>/<split>/<index>"."""
    prompt: str
    """Text the model continues (without BOS)."""
    key: str
    """Canonical problem identity; the split is a function of it."""
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """JSON-serialisable problem data the verifier needs (e.g. the answer)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Task:
        return cls(**data)


class TaskSet(ABC):
    """A task family with a train stream, a held-out list, a verifier and demonstrations."""

    name: str = ""

    def __init__(self, cfg: TaskConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer

    @property
    def num_train(self) -> int:
        return self.cfg.num_train

    @abstractmethod
    def train(self, index: int) -> Task:
        """The index-th training task (index >= 0; wraps at num_train)."""

    @abstractmethod
    def heldout(self) -> list[Task]:
        """The held-out evaluation tasks (disjoint from the train split)."""

    @abstractmethod
    def verify(self, task: Task, completion: str) -> Verdict:
        """Score a completion. Must not raise or hang on any string (hostile model output)."""

    @abstractmethod
    def demonstration(self, task: Task) -> str:
        """The SFT target: a completion that verify() scores 1.0, unless the task set simulates an
        imperfect teacher (arithmetic's `task.demo_drop_carry`, reasoning_gym's
        `task.demo_reversed`)."""

    def reference(self, task: Task) -> str:
        """A completion that verify() scores 1.0, whatever the teacher (what `slipstream task
        check` scores). Task sets with an imperfect teacher override it."""
        return self.demonstration(task)

    def train_batch(self, start: int, n: int) -> list[Task]:
        return [self.train(start + i) for i in range(n)]

    def prompt_ids(self, task: Task) -> list[int]:
        return [self.tokenizer.bos_id, *self.tokenizer.encode(task.prompt)]

    def completion_ids(self, text: str) -> list[int]:
        """Tokens of a completion text followed by EOS (the SFT target)."""
        return [*self.tokenizer.encode(text), self.tokenizer.eos_id]


class SandboxedTaskSet(TaskSet):
    """A task set whose verifier executes model output, so it verifies inside a sandbox: the RL
    loop (rl/verifier.py) calls `averify` with a sandbox from its pool, and
    `sandbox.verify_in_sandbox = auto` picks that for exactly these task sets."""

    @abstractmethod
    async def averify(self, task: Task, completion: str, sandbox: Sandbox) -> Verdict:
        """Score a completion by running it in `sandbox` (any `slipstream.sandbox.Sandbox`).
        Must not raise or hang on any string, as `verify`."""


class GeneratedTaskSet(TaskSet):
    """A TaskSet backed by a seeded generator of random problems, split by key hash."""

    @abstractmethod
    def generate(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        """One random problem: (key, prompt, meta)."""

    def __init__(self, cfg: TaskConfig, tokenizer: Tokenizer) -> None:
        super().__init__(cfg, tokenizer)
        self._heldout: list[Task] | None = None

    def is_heldout_key(self, key: str) -> bool:
        return keyed_uniform(self.cfg.seed, self.name, key) < self.cfg.heldout_fraction

    def train(self, index: int) -> Task:
        if index < 0:
            raise IndexError(f"{self.name}: train index {index} is negative")
        index %= self.num_train
        rng = random.Random(f"{self.cfg.seed}|{self.name}|train|{index}")
        for _ in range(MAX_DRAWS):
            key, prompt, meta = self.generate(rng)
            if not self.is_heldout_key(key):
                return Task(f"{self.name}/train/{index}", prompt, key, meta)
        raise RuntimeError(
            f"{self.name}: no train problem in {MAX_DRAWS} draws; task.heldout_fraction "
            f"{self.cfg.heldout_fraction} leaves no room for training"
        )

    def heldout(self) -> list[Task]:
        if self._heldout is None:
            self._heldout = self._make_heldout()
        return list(self._heldout)

    def _make_heldout(self) -> list[Task]:
        rng = random.Random(f"{self.cfg.seed}|{self.name}|heldout")
        tasks: list[Task] = []
        seen: set[str] = set()
        budget = MAX_DRAWS + 1000 * self.cfg.num_heldout
        for _ in range(budget):
            key, prompt, meta = self.generate(rng)
            if key in seen or not self.is_heldout_key(key):
                continue
            seen.add(key)
            tasks.append(Task(f"{self.name}/heldout/{len(tasks)}", prompt, key, meta))
            if len(tasks) == self.cfg.num_heldout:
                return tasks
        raise RuntimeError(
            f"{self.name}: found only {len(tasks)} distinct held-out problems of "
            f"task.num_heldout={self.cfg.num_heldout} in {budget} draws; make the problem space "
            f"larger or raise task.heldout_fraction"
        )


def get_taskset(cfg: TaskConfig, tokenizer: Tokenizer | None = None) -> TaskSet:
    """The TaskSet named by `cfg.name`. The tokenizer defaults to `load_tokenizer(cfg.tokenizer)`.

    Task modules are imported on demand, so a task with heavy dependencies (code: sandboxes)
    costs nothing unless it is used."""
    from slipstream.model.tokenizer import load_tokenizer

    module_name = _MODULES.get(cfg.name, f"slipstream.tasks.{cfg.name}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            raise ValueError(f"task.name = {cfg.name!r}: no module {module_name}") from e
        raise
    make = getattr(module, "make_taskset", None)
    if make is None:
        raise ValueError(
            f"task.name = {cfg.name!r}: {module_name} has no make_taskset(cfg, tokenizer)"
        )
    return make(cfg, tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer))
