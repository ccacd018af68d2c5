"""`[task]`: which verifiable task (a built-in generator, your own data files, or a
reasoning-gym mix), and how its splits are made. Data files and reasoning-gym: docs/data.md."""

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from slipstream.config.base import Section

Layout = Literal["auto", "trl", "verl", "openrlhf", "question"]


class DataSource(Section):
    """One entry of `task.train_files` / `task.heldout_files` written as a table:
    `{path = "s3://bucket/math/*.parquet", weight = 2.0}`. A plain string is the same with
    weight 1."""

    path: str = ""
    """(Required.) A file, a glob (`data/*.jsonl`, `s3://bucket/prefix/*.parquet`) or a `file://` URL. Format by
    suffix: .jsonl/.ndjson, .json (an array or JSON lines), .parquet, .csv. Every file a glob
    matches belongs to this one source."""
    weight: float = Field(default=1.0, gt=0)
    """Share of training prompts drawn from this source (weights are normalised over the sources)."""


class GymEntry(Section):
    """One `[[task.gym]]` entry of `task.name = "reasoning_gym"`."""

    name: str = ""
    """(Required.) A reasoning-gym dataset name (`reasoning_gym.create_dataset(name, ...)`), e.g.
    "basic_arithmetic", "chain_sum", "spell_backward"."""
    weight: float = Field(default=1.0, gt=0)
    """Share of training prompts drawn from this dataset."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The dataset's own config options (its `*Config` dataclass fields, e.g. `{min_terms = 2,
    max_terms = 3}`), passed to `create_dataset` as keyword arguments."""


class TaskConfig(Section):
    name: Literal[
        "arithmetic", "countdown", "code", "tool_arithmetic", "dataset", "reasoning_gym"
    ] = "arithmetic"
    """Built-in task: multi-digit arithmetic, Countdown, sandboxed code problems, or arithmetic
    whose teacher sometimes uses the `<py>` tool (`tool_arithmetic`, for `env = "python_tool"`);
    `dataset`: your own prompt files (`train_files`, docs/data.md); `reasoning_gym`: a weighted
    mix of reasoning-gym's procedural tasks (`[[task.gym]]`), scored by their `score_answer`."""
    env: Literal["single_turn", "python_tool", "code_tests", "agent"] = "single_turn"
    """Rollout environment (slipstream.envs, docs/envs.md): `single_turn` (the prompt, one
    completion, the verifier's reward), `python_tool` (the policy may run `<py>...</py>` programs
    in the episode's sandbox before it answers), `code_tests` (the `code` task, revised against
    visible tests run in the episode's sandbox). Environments with sandboxes use [sandbox]."""
    seed: int = Field(default=1234, ge=0)
    """Seed of the task generator (train and held-out splits are disjoint for a seed)."""
    num_train: int = Field(default=20000, ge=1)
    """Training prompts (train indices wrap around at this count)."""
    num_heldout: int = Field(default=200, ge=1)
    """Held-out prompts for evaluation."""
    heldout_fraction: float = Field(default=0.1, gt=0, lt=1)
    """Share of the problem-key space reserved for the held-out split (by keyed hash)."""
    tokenizer: str = "char"
    """`char` (built-in character vocabulary), or a path to a tokenizer.json / a directory holding one."""
    max_digits: int = Field(default=2, ge=1, le=18)
    """Arithmetic: operands have up to this many digits."""
    min_digits: int = Field(default=1, ge=1, le=18)
    """Arithmetic: operands have at least this many digits (digit count is uniform in the range)."""
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-", "*"], min_length=1)
    """Arithmetic: operators to draw from (uniformly)."""
    demo_drop_carry: float = Field(default=0.0, ge=0, le=1)
    """Arithmetic: share of `+`/`-` problems needing a carry or borrow whose SFT demonstration drops
    it (digit-wise, as a weak teacher does: 57+68 -> "15"). Simulates demonstrations from an
    imperfect teacher; the verifier, rewards and evaluation stay exact. 0 = perfect demonstrations."""
    demo_reversed: float = Field(default=0.0, ge=0, le=1)
    """reasoning_gym: share of problems (a keyed hash of the problem) whose SFT demonstration writes
    the answer backwards ("105" -> "501", "ognib" -> "bingo"), a systematic mistake as a weak
    teacher makes; answers that read the same both ways stay. Simulates demonstrations from an
    imperfect teacher, as `demo_drop_carry` does for arithmetic; the verifier (score_answer),
    rewards and evaluation stay exact. 0 = the datasets' own answers."""
    demo_tool_use: float = Field(default=0.0, ge=0, le=1)
    """tool_arithmetic: share of problems (a keyed hash of the problem) whose SFT demonstration
    runs the answer through the `<py>` tool (`<py>a*b</py>`, its output, the answer); the rest
    answer without it (see demo_tool_min_lead). The imperfect teacher of configs/agentic.toml."""
    demo_tool_min_lead: int = Field(default=10, ge=1, le=10)
    """tool_arithmetic: the teacher always uses the tool when the first operand's leading digit
    is at least this (10 = never by this rule; only demo_tool_use's share)."""
    countdown_numbers: int = Field(default=4, ge=2, le=5)
    """Countdown: how many numbers are given (the demonstration solver is exhaustive, hence <= 5)."""
    countdown_max_number: int = Field(default=20, ge=2, le=1000)
    """Countdown: given numbers are drawn from 1..this."""
    countdown_max_target: int = Field(default=100, ge=2, le=100000)
    """Countdown: targets are in 1..this."""

    train_files: list[DataSource] = Field(default_factory=list)
    """dataset: training data, a list of paths/globs/URLs (local, `file://`, `s3://`) or tables
    `{path = ..., weight = ...}`; each entry is one source, sources mix by weight. JSONL, JSON,
    Parquet or CSV, streamed (never read whole into memory)."""
    heldout_files: list[DataSource] = Field(default_factory=list)
    """dataset: evaluation data. Empty: a keyed hash of each row's prompt puts `heldout_fraction`
    of the train files' rows in the held-out split instead (disjoint by construction: a prompt is
    in exactly one split)."""
    layout: Layout = "auto"
    """dataset: column layout. `trl`: `prompt` (a string or chat messages) + columns, answer in
    `answer`/`solution`/`ground_truth`, SFT target in `completion`; `verl`: `prompt` messages,
    answer in `reward_model.ground_truth` (+ `data_source`, `extra_info`); `openrlhf`: `input`
    and `label` (OpenRLHF's and slime's --input_key / --label_key defaults); `question`:
    `question` + `answer` (verifiers, reasoning-gym exports). `auto` picks per file from its
    first row's columns. prompt_key / answer_key / completion_key override any of them."""
    prompt_key: str = ""
    """dataset: the prompt column (a string, or a list of `{role, content}` messages rendered with
    the tokenizer's chat template). Empty: from `layout`. OpenRLHF's/slime's `input_key`."""
    answer_key: str = ""
    """dataset: the reference-answer column; a dotted path reaches into a struct column
    (`reward_model.ground_truth`). Empty: from `layout`. OpenRLHF's/slime's `label_key`."""
    completion_key: str = ""
    """dataset: the SFT target column (a string, or assistant messages). Empty: `completion` when
    the file has it; without one, SFT trains on the reference answer."""
    system_prompt: str = ""
    """dataset: a system message put before every prompt that has none (a string prompt then
    becomes chat messages and goes through the chat template)."""
    overlong: Literal["skip", "error"] = "skip"
    """dataset: a prompt longer than `max_prompt_tokens`: `skip` the row (counted per source,
    logged, shown by `slipstream task check`), or `error` (stop, naming the file and row)."""
    max_prompt_tokens: int = Field(default=0, ge=0)
    """dataset: the longest prompt (tokens, BOS and chat template included) a row may have.
    0 = model.max_position_embeddings minus the completion cap (rollout.max_new_tokens, else
    engine.max_new_tokens), resolved at load."""
    shuffle_buffer: int = Field(default=10_000, ge=1)
    """dataset: rows shuffled together (the memory bound: about this many rows are held per
    process). Order: a seeded permutation of `block_rows`-row blocks, then a seeded permutation
    of the rows of each window of shuffle_buffer rows; a fresh permutation every epoch."""
    block_rows: int = Field(default=256, ge=1, le=65_535)
    """dataset: rows per read (a Parquet batch, a run of JSONL lines / CSV records)."""
    data_endpoint_url: str = ""
    """dataset: S3 endpoint for `s3://` data files other than AWS's (MinIO, moto); credentials
    come from the usual AWS environment variables / files."""
    gym: list[GymEntry] = Field(default_factory=list)
    """reasoning_gym: the `[[task.gym]]` datasets to mix (name, weight, options); generated
    with task.seed, train and held-out disjoint by a keyed hash of the question."""

    @field_validator("train_files", "heldout_files", mode="before")
    @classmethod
    def _sources(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            return [{"path": v} if isinstance(v, str) else v for v in value]
        return value

    @model_validator(mode="after")
    def _digits_ordered(self) -> "TaskConfig":
        if self.min_digits > self.max_digits:
            raise ValueError(
                f"task.min_digits ({self.min_digits}) must be <= task.max_digits ({self.max_digits})"
            )
        for key, sources in (
            ("train_files", self.train_files),
            ("heldout_files", self.heldout_files),
        ):
            for k, src in enumerate(sources):
                if not src.path:
                    raise ValueError(f"task.{key}[{k}]: path is empty (a file, glob or URL)")
        for k, g in enumerate(self.gym):
            if not g.name:
                raise ValueError(f"task.gym[{k}]: name is empty (a reasoning-gym dataset name)")
        if self.name == "dataset" and not self.train_files:
            raise ValueError(
                "task.name = 'dataset' needs task.train_files (paths, globs or s3:// URLs of "
                "JSONL / JSON / Parquet / CSV files; docs/data.md)"
            )
        if self.name == "reasoning_gym" and not self.gym:
            raise ValueError(
                "task.name = 'reasoning_gym' needs at least one [[task.gym]] entry "
                '(name = "basic_arithmetic", weight = 1.0, options = {...})'
            )
        return self
