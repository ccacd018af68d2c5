"""`task.name = "dataset"`: prompts (and reference answers) from your own files.

    [task]
    name = "dataset"
    train_files = ["data/train-*.jsonl", {path = "s3://bucket/math.parquet", weight = 2.0}]
    # heldout_files = [...]      # else a keyed hash holds out task.heldout_fraction of the prompts

A row becomes a `Task` whose `meta` carries what reward functions receive (TRL's signature):

    meta["prompt"]   the prompt as the model is given it: a string, or chat messages (TRL's `prompts`)
    meta["answer"]   the reference answer (task.answer_key, dotted paths reach into structs) or None
    meta["columns"]  every column but the prompt, the answer's column too, JSON-serialisable
    meta["origin"]   "file:row" (1-based), for error messages and `slipstream task check`

**Layouts** (`task.layout`, `auto` = per file from its first row): TRL (`prompt` + columns; answer
in `answer` / `solution` / `ground_truth`; SFT target in `completion`), verl (`prompt` messages,
`reward_model.ground_truth`, `data_source`, `extra_info`), OpenRLHF / slime (`input`, `label`),
`question` + `answer`. `prompt_key` / `answer_key` / `completion_key` override the layout.

**Prompts.** A string prompt is fed as `[bos] + encode(prompt)` (TRL's "standard" prompt); chat
messages go through the tokenizer's own chat template (`Tokenizer.chat_prompt`, equal to
transformers' `apply_chat_template(..., add_generation_prompt=True)`). `task.system_prompt` is put
before a prompt that has no system message (a string prompt then becomes messages).

**Streaming and order.** Nothing is read whole (except a `.json` array). At construction one
streaming pass indexes each source: the start of every `block_rows`-row block, which rows of it are
held out (keyed hash of the prompt) and which are skipped (too long, `task.overlong = "skip"`),
and validates every row (a bad row is a one-line `DataError` naming file, row and column). Then
`train(i)` is a pure function of (task.seed, i): position i of the weighted mix picks a source
and that source's j-th row; within a source, epoch e = j // N is a seeded permutation of its
blocks, cut into windows of `shuffle_buffer` rows, each window's rows permuted again. So a
process holds about `shuffle_buffer` rows (the blocks of the windows it is serving), any process
(rollout workers on other hosts) computes the same task for the same i, and a resumed job that
restores the queue (whose task ids are these i) continues the exact order: no cursor beyond the
queue's own snapshot is needed.

Not covered: a cache of the index across processes (each process makes the pass: tokenising
every prompt once; docs/data.md gives the cost), deduplication of identical prompts inside a split.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from slipstream.config.base import MAX_INT
from slipstream.tasks.base import Task, TaskSet, Verdict, keyed_uniform
from slipstream.tasks.datafiles import Block, DataError, DataFile, expand

if TYPE_CHECKING:
    from slipstream.config.task import DataSource, TaskConfig
    from slipstream.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Column names each layout reads: (prompt, answer candidates, completion).
LAYOUTS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "verl": ("prompt", ("reward_model.ground_truth",), "completion"),
    "trl": ("prompt", ("answer", "solution", "ground_truth"), "completion"),
    "openrlhf": ("input", ("label",), "output"),
    "question": ("question", ("answer",), "completion"),
}
# Positions of the mix's repeating pattern (sources are placed by weight within each period).
MIX_PERIOD = 1024
_SPACE_RE = re.compile(r"\s+")


def detect_layout(row: dict[str, Any]) -> str:
    """The layout of a file from its first row's columns (`task.layout = "auto"`)."""
    if "prompt" in row:
        return "verl" if isinstance(row.get("reward_model"), dict) else "trl"
    if "input" in row:
        return "openrlhf"
    if "question" in row:
        return "question"
    raise DataError(
        f"no prompt column found among {sorted(row)}: expected 'prompt' (TRL, verl), 'input' "
        "(OpenRLHF, slime) or 'question'; or set task.prompt_key"
    )


def _get(row: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def json_safe(value: Any) -> Any:
    """`value` with every leaf JSON-serialisable (Parquet gives dates, decimals, bytes)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


@dataclass(frozen=True)
class Columns:
    """Where a file's prompt, answer and SFT target are."""

    prompt: str
    answer: str | None
    answer_required: bool
    completion: str | None


@dataclass
class ParsedRow:
    prompt: str | list[dict[str, str]]
    answer: Any
    columns: dict[str, Any]
    completion: Any
    key: str
    origin: str


@dataclass
class SourceStats:
    """Counts of one source's indexing pass (shown by `slipstream task check`)."""

    label: str
    files: int = 0
    rows: int = 0
    train: int = 0
    heldout: int = 0
    skipped_overlong: int = 0
    longest_skipped: int = 0


@dataclass
class _BlockInfo:
    file: int
    block: Block
    heldout: array = field(default_factory=lambda: array("H"))
    skipped: array = field(default_factory=lambda: array("H"))

    def count(self, split: str) -> int:
        n = len(self.heldout) if split == "heldout" else self.block.rows - len(self.heldout)
        return n - sum(1 for s in self.skipped if self._in(split, s))

    def _in(self, split: str, offset: int) -> bool:
        return (offset in self.heldout) == (split == "heldout")

    def keep(self, split: str, offset: int) -> bool:
        return self._in(split, offset) and offset not in self.skipped


class Source:
    """The rows of one train_files / heldout_files entry: indexed once, read by block."""

    def __init__(
        self, ts: DatasetTaskSet, index: int, spec: DataSource, what: str, hash_split: bool
    ) -> None:
        self.ts = ts
        self.index = index
        self.weight = spec.weight
        self.what = what
        self.hash_split = hash_split
        self.files: list[DataFile] = expand(spec.path, ts.cfg.data_endpoint_url, what)
        self.stats = SourceStats(label=f"{what} = {spec.path!r}", files=len(self.files))
        self._columns: dict[int, Columns] = {}
        self.blocks: list[_BlockInfo] = []
        self._lock = threading.RLock()
        self._block_cache: OrderedDict[int, list[ParsedRow]] = OrderedDict()
        self._epoch_cache: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = (
            OrderedDict()
        )
        self._window_cache: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._build_index()

    # -- the indexing pass --------------------------------------------------------------------

    def _build_index(self) -> None:
        block_rows = self.ts.cfg.block_rows
        for fi, f in enumerate(self.files):
            for block in f.blocks(block_rows):
                info = _BlockInfo(fi, Block(fi, block.index, block.start, block.rows, block.pos))
                for k, row in enumerate(f.read_block(block, block_rows)):
                    parsed = self.parse(fi, row, block.start + k)
                    held = self.hash_split and self.ts.is_heldout_key(parsed.key)
                    if held:
                        info.heldout.append(k)
                    n_tokens = len(self.ts.ids_of_prompt(parsed.prompt, parsed.origin))
                    if n_tokens > self.ts.cfg.max_prompt_tokens > 0:
                        if self.ts.cfg.overlong == "error":
                            raise DataError(
                                f"{parsed.origin}: the prompt is {n_tokens} tokens, longer than "
                                f"task.max_prompt_tokens = {self.ts.cfg.max_prompt_tokens} "
                                "(task.overlong = 'skip' skips such rows)"
                            )
                        info.skipped.append(k)
                        self.stats.skipped_overlong += 1
                        self.stats.longest_skipped = max(self.stats.longest_skipped, n_tokens)
                    elif held:
                        self.stats.heldout += 1
                    else:
                        self.stats.train += 1
                self.stats.rows += block.rows
                self.blocks.append(info)

    def columns_of(self, fi: int, row: dict[str, Any], origin: str) -> Columns:
        cols = self._columns.get(fi)
        if cols is not None:
            return cols
        cfg = self.ts.cfg
        layout = cfg.layout
        if layout == "auto" and not cfg.prompt_key:
            try:
                layout = detect_layout(row)
            except DataError as e:
                raise DataError(f"{origin}: {e}") from None
        prompt_key, answers, completion = LAYOUTS.get(layout, ("prompt", ("answer",), "completion"))
        if cfg.answer_key:
            answer, required = cfg.answer_key, True
        else:
            answer = next((a for a in answers if _get(row, a)[0]), None)
            required = False
        cols = Columns(
            prompt=cfg.prompt_key or prompt_key,
            answer=answer,
            answer_required=required,
            completion=cfg.completion_key or (completion if completion in row else None),
        )
        self._columns[fi] = cols
        return cols

    def parse(self, fi: int, row: dict[str, Any], rownum: int) -> ParsedRow:
        """Validate one row and split it into prompt / answer / columns; DataError names the
        file, the row and the column."""
        origin = f"{self.files[fi].url}:{rownum + 1}"
        cols = self.columns_of(fi, row, origin)
        if cols.prompt not in row:
            raise DataError(
                f"{origin}: no column {cols.prompt!r} (the prompt; columns: "
                f"{', '.join(sorted(row)) or 'none'}); set task.prompt_key"
            )
        prompt = self.ts.normalise_prompt(row[cols.prompt], f"{origin}: column {cols.prompt!r}")
        answer = None
        if cols.answer is not None:
            found, answer = _get(row, cols.answer)
            if not found and cols.answer_required:
                raise DataError(f"{origin}: no column {cols.answer!r} (task.answer_key)")
        completion = None
        if cols.completion is not None:
            if cols.completion not in row:
                raise DataError(f"{origin}: no column {cols.completion!r} (task.completion_key)")
            completion = completion_text(
                row[cols.completion], f"{origin}: column {cols.completion!r}"
            )
        columns = {k: json_safe(v) for k, v in row.items() if k != cols.prompt}
        key = json.dumps(prompt, sort_keys=True, ensure_ascii=False)
        return ParsedRow(prompt, json_safe(answer), columns, completion, key, origin)

    # -- reading rows -------------------------------------------------------------------------

    def count(self, split: str) -> int:
        return sum(b.count(split) for b in self.blocks)

    def block_rows_of(self, bi: int, split: str) -> list[ParsedRow]:
        """The kept rows of block `bi` for `split` (LRU-cached: about shuffle_buffer rows)."""
        key = bi if split == "train" else -1 - bi
        with self._lock:
            rows = self._block_cache.get(key)
            if rows is not None:
                self._block_cache.move_to_end(key)
                return rows
        info = self.blocks[bi]
        f = self.files[info.file]
        raw = f.read_block(info.block, self.ts.cfg.block_rows)
        rows = [
            self.parse(info.file, r, info.block.start + k)
            for k, r in enumerate(raw)
            if info.keep(split, k)
        ]
        with self._lock:
            self._block_cache[key] = rows
            limit = 2 * self._window_blocks() + 2
            while len(self._block_cache) > limit:
                self._block_cache.popitem(last=False)
        return rows

    def _window_blocks(self) -> int:
        return max(1, self.ts.cfg.shuffle_buffer // self.ts.cfg.block_rows)

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        with self._lock:
            hit = self._epoch_cache.get(epoch)
            if hit is not None:
                return hit
            rng = np.random.default_rng([self.ts.cfg.seed, self.index, epoch])
            perm = rng.permutation(len(self.blocks))
            counts = np.array([self.blocks[b].count("train") for b in perm], dtype=np.int64)
            cum = np.concatenate([[0], np.cumsum(counts)])
            windows = cum[:: self._window_blocks()]
            if windows[-1] != cum[-1]:
                windows = np.concatenate([windows, cum[-1:]])
            self._epoch_cache[epoch] = (perm, cum, windows)
            while len(self._epoch_cache) > 2:
                self._epoch_cache.popitem(last=False)
            return perm, cum, windows

    def _window_perm(self, epoch: int, w: int, n: int) -> np.ndarray:
        with self._lock:
            hit = self._window_cache.get((epoch, w))
            if hit is None:
                rng = np.random.default_rng([self.ts.cfg.seed, self.index, epoch, w, 1])
                hit = rng.permutation(n)
                self._window_cache[(epoch, w)] = hit
                while len(self._window_cache) > 4:
                    self._window_cache.popitem(last=False)
            return hit

    def train_row(self, j: int) -> ParsedRow:
        """The j-th training row of this source's endless, epoch-by-epoch shuffled stream."""
        n = self.count_train
        epoch, r = divmod(j, n)
        perm, cum, windows = self._epoch(epoch)
        w = int(np.searchsorted(windows, r, side="right")) - 1
        lo, hi = int(windows[w]), int(windows[w + 1])
        q = lo + int(self._window_perm(epoch, w, hi - lo)[r - lo])
        pos = int(np.searchsorted(cum, q, side="right")) - 1
        return self.block_rows_of(int(perm[pos]), "train")[q - int(cum[pos])]

    def iter_split(self, split: str) -> Any:
        """Kept rows of `split` in file order (held-out draws, task check)."""
        for bi in range(len(self.blocks)):
            if self.blocks[bi].count(split):
                yield from self.block_rows_of(bi, split)

    @functools.cached_property
    def count_train(self) -> int:
        """Training rows (the index is fixed once built)."""
        return self.count("train")


def completion_text(value: Any, where: str) -> str:
    """An SFT target: a string, or assistant messages (TRL's conversational completion)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("content"), str) for m in value
    ):
        return "".join(m["content"] for m in value if m.get("role", "assistant") == "assistant")
    raise DataError(
        f"{where}: a completion must be a string or a list of assistant messages, got "
        f"{type(value).__name__}"
    )


def mix_pattern(weights: list[float], seed: int) -> tuple[list[int], list[int], list[int]]:
    """Positions of one mix period: (source of each slot, rank of the slot among its source's
    slots, slots per source). Largest-remainder counts, each source at least one slot, in a
    seeded order; position i is slot i % MIX_PERIOD of period i // MIX_PERIOD."""
    total = sum(weights)
    period = max(MIX_PERIOD, len(weights))
    exact = [w / total * (period - len(weights)) for w in weights]
    counts = [1 + int(x) for x in exact]
    rest = period - sum(counts)
    for s in sorted(range(len(weights)), key=lambda s: int(exact[s]) - exact[s])[:rest]:
        counts[s] += 1
    slots = [s for s, c in enumerate(counts) for _ in range(c)]
    order = np.random.default_rng([seed, 0x6D6978]).permutation(len(slots))
    slots = [slots[k] for k in order]
    seen = [0] * len(weights)
    ranks = []
    for s in slots:
        ranks.append(seen[s])
        seen[s] += 1
    return slots, ranks, counts


class DatasetTaskSet(TaskSet):
    name = "dataset"

    def __init__(self, cfg: TaskConfig, tokenizer: Tokenizer) -> None:
        super().__init__(cfg, tokenizer)
        hash_split = not cfg.heldout_files
        self.sources = [
            Source(self, i, s, f"task.train_files[{i}]", hash_split)
            for i, s in enumerate(cfg.train_files)
        ]
        if hash_split:
            self.heldout_sources = self.sources
        else:
            self.heldout_sources = [
                Source(self, i, s, f"task.heldout_files[{i}]", False)
                for i, s in enumerate(cfg.heldout_files)
            ]
        for src in self.sources:
            if src.count_train == 0:
                raise DataError(
                    f"{src.stats.label}: no training rows ({src.stats.rows} rows, "
                    f"{src.stats.heldout} held out, {src.stats.skipped_overlong} skipped as too long)"
                )
        self._slots, self._ranks, self._counts = mix_pattern(
            [s.weight for s in self.sources], cfg.seed
        )
        self._heldout: list[Task] | None = None
        for src in {id(s): s for s in self.sources + self.heldout_sources}.values():
            st = src.stats
            if st.skipped_overlong:
                log.warning(
                    "%s: %d of %d rows skipped: prompt longer than task.max_prompt_tokens = %d "
                    "(longest %d tokens)", st.label, st.skipped_overlong, st.rows,
                    cfg.max_prompt_tokens, st.longest_skipped,
                )  # fmt: skip

    @property
    def num_train(self) -> int:
        """Train indices never wrap: every index is a row of a fresh epoch's shuffle."""
        return MAX_INT

    def stats(self) -> list[SourceStats]:
        out = {id(s): s.stats for s in self.sources + self.heldout_sources}
        return list(out.values())

    # -- prompts ----------------------------------------------------------------------------

    def is_heldout_key(self, key: str) -> bool:
        return keyed_uniform(self.cfg.seed, self.name, key) < self.cfg.heldout_fraction

    def normalise_prompt(self, value: Any, where: str) -> str | list[dict[str, str]]:
        """A string, or messages with string roles and contents; the system prompt put first."""
        system = self.cfg.system_prompt
        if isinstance(value, str):
            if not system:
                return value
            value = [{"role": "user", "content": value}]
        if not isinstance(value, list) or not value:
            raise DataError(
                f"{where}: a prompt must be a string or a non-empty list of {{role, content}} "
                f"messages, got {type(value).__name__ if value != [] else 'an empty list'}"
            )
        messages = []
        for m in value:
            if not (
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                raise DataError(
                    f"{where}: a chat message must be {{role: str, content: str}}, got "
                    f"{json.dumps(json_safe(m))[:80]}"
                )
            messages.append({"role": m["role"], "content": m["content"]})
        if system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
        return messages

    def ids_of_prompt(self, prompt: str | list[dict[str, str]], origin: str) -> list[int]:
        try:
            if isinstance(prompt, str):
                return [self.tokenizer.bos_id, *self.tokenizer.encode(prompt)]
            return self.tokenizer.chat_prompt(prompt, add_generation_prompt=True)
        except ValueError as e:
            raise DataError(f"{origin}: the prompt cannot be tokenised: {e}") from None

    def prompt_ids(self, task: Task) -> list[int]:
        return self.ids_of_prompt(task.meta["prompt"], task.meta["origin"])

    def prompt_text(self, prompt: str | list[dict[str, str]]) -> str:
        """What the model sees, as text (the rendered chat template for messages)."""
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(self.ids_of_prompt(prompt, ""), skip_special_tokens=False)

    def _task(self, row: ParsedRow, task_id: str) -> Task:
        meta = {
            "prompt": row.prompt,
            "answer": row.answer,
            "columns": row.columns,
            "origin": row.origin,
        }
        if row.completion is not None:
            meta["completion"] = row.completion
        return Task(task_id, self.prompt_text(row.prompt), row.key, meta)

    # -- the TaskSet contract ------------------------------------------------------------------

    def train(self, index: int) -> Task:
        if index < 0:
            raise IndexError(f"dataset: train index {index} is negative")
        period, slot = divmod(index, len(self._slots))
        s = self._slots[slot]
        j = period * self._counts[s] + self._ranks[slot]
        return self._task(self.sources[s].train_row(j), f"dataset/train/{index}")

    def heldout(self) -> list[Task]:
        """task.num_heldout rows (fewer when the split has fewer), shared among the held-out
        sources by weight, each source's first rows in file order."""
        if self._heldout is None:
            want = self.cfg.num_heldout
            srcs = self.heldout_sources
            total = sum(s.weight for s in srcs)
            quota = [max(1, round(want * s.weight / total)) for s in srcs]
            rows: list[ParsedRow] = []
            for s, q in zip(srcs, quota, strict=True):
                for k, row in enumerate(s.iter_split("heldout" if s.hash_split else "train")):
                    if k >= q or len(rows) >= want:
                        break
                    rows.append(row)
            if not rows:
                raise DataError(
                    "dataset: the held-out split is empty (no row's prompt hashed into "
                    f"task.heldout_fraction = {self.cfg.heldout_fraction}); add task.heldout_files"
                )
            if len(rows) < want:
                log.warning("dataset: %d held-out prompts (task.num_heldout = %d)", len(rows), want)
            self._heldout = [self._task(r, f"dataset/heldout/{k}") for k, r in enumerate(rows)]
        return list(self._heldout)

    def verify(self, task: Task, completion: str) -> Verdict:
        """The fallback verifier (configured reward functions replace it): the completion equals
        the reference answer, whitespace-normalised."""
        answer = task.meta.get("answer")
        if answer is None:
            return Verdict(0.0, "no reference answer (configure reward functions)")
        want = _SPACE_RE.sub(" ", str(answer)).strip()
        got = _SPACE_RE.sub(" ", completion).strip()
        if got == want:
            return Verdict(1.0, "correct")
        return Verdict(0.0, f"wrong answer: got {got[:40]!r}, expected {want[:40]!r}")

    def demonstration(self, task: Task) -> str:
        """The SFT target: the completion column when the data has one, else the answer."""
        if "completion" in task.meta:
            return task.meta["completion"]
        answer = task.meta.get("answer")
        if answer is None:
            raise DataError(
                f"{task.meta['origin']}: SFT needs a completion or an answer column "
                "(task.completion_key / task.answer_key)"
            )
        return answer if isinstance(answer, str) else json.dumps(answer)


def make_taskset(cfg: TaskConfig, tokenizer: Tokenizer) -> DatasetTaskSet:
    return DatasetTaskSet(cfg, tokenizer)
