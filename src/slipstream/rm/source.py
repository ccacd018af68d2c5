"""The `reward_model` kind of `[[reward.functions]]`: rollout workers score every completion with
a reward model, alone or with the task's verifier and the other reward functions (docs/rlhf.md,
docs/rewards.md). This module assembles the worker's reward (it can import rm; slipstream/rewards
cannot):

    verifier = make_reward_source(cfg, make_verifier(...))   # the worker's Verifier
    score_pairs(cfg, [(task, completion), ...])              # `slipstream task check`

- `Scorer` (the seam): `score(texts) -> raw rewards`, raising `ServiceUnavailable` (an
  InfraError) when the reward model cannot answer (unreachable, error status, timeout).
  `HTTPScorer`: POST /classify of a reward-model server (`slipstream serve --model RM_DIR`, or
  vLLM / SGLang serving a classification model: `data[i].logits`, else the logit of
  `data[i].probs`). `InProcessScorer`: the model in this process.
- `BatchingScorer`: completions of all the worker's groups, verified concurrently on its thread
  pool, are coalesced into one call of at most `reward.max_batch` texts (a call waits at most
  `reward.batch_window_s` for company); every waiter gets its own result or the call's error.
- `RewardModelScorer`: the kind's scorer: sigmoid(score) of task.prompt + completion.
  `make_reward_source` puts it into a `RewardSet` (slipstream/rewards) with the task's verifier:
  reward.source = "reward_model" is [verifier x 0, reward_model x 1]; "combined" with "sum" is
  [verifier x verifier_weight, reward_model x rm_weight]; "gate" is [verifier x 0, reward_model
  x 1 gated by the verifier] (a failed verdict skips the model). The task's verdict is always
  computed and kept in the reason ("verifier=1 (correct) reward_model=0.83 (score=1.59)").

The never-a-reward rule: a scoring failure raises ServiceUnavailable; the episode runner gives the
group up and the worker nacks its task (requeued, redelivered later), so no group is ever
rewarded by a failure (envs/episode.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from slipstream.envs.base import ServiceUnavailable
from slipstream.tasks import Task

if TYPE_CHECKING:
    from slipstream.config import SlipstreamConfig
    from slipstream.rl.verifier import Verifier

log = logging.getLogger(__name__)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


class Scorer(Protocol):
    def score(self, texts: list[str]) -> list[float]:
        """Raw rewards (the model's logit) of the texts, in order; ServiceUnavailable when the
        reward model cannot answer."""
        ...

    def close(self) -> None: ...


class HTTPScorer:
    """POST /classify of a reward-model server; one pooled httpx client, callable from any
    thread. No retries here: the caller requeues the task."""

    def __init__(self, url: str, timeout_s: float, api_key: str | None = None) -> None:
        self.url = url.rstrip("/") + "/classify"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=timeout_s, headers=headers)

    def score(self, texts: list[str]) -> list[float]:
        try:
            r = self._client.post(self.url, json={"input": texts})
        except httpx.HTTPError as e:
            raise ServiceUnavailable(f"reward model {self.url}: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise ServiceUnavailable(f"reward model {self.url}: HTTP {r.status_code}: "
                                     f"{r.text[:200]}")  # fmt: skip
        try:
            data = sorted(r.json()["data"], key=lambda d: d["index"])
            out = [_logit_of(d) for d in data]
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise ServiceUnavailable(f"reward model {self.url}: malformed answer: {e}") from e
        if len(out) != len(texts):
            raise ServiceUnavailable(f"reward model {self.url}: {len(out)} scores for "
                                     f"{len(texts)} inputs")  # fmt: skip
        return out

    def close(self) -> None:
        self._client.close()


def _finite_number(value: Any, what: str) -> float:
    """`value` as a float when it is a finite JSON number; ValueError for anything else. Python's
    json accepts NaN and Infinity, and float() takes "1e400", "9" and True: none of them is a
    score, and a garbage answer must never become a reward (issue 44)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} is {value!r} ({type(value).__name__}), not a number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{what} is {value!r}, not a finite number")
    return out


def _logit_of(d: dict[str, Any]) -> float:
    """The raw reward of one classify result: our `logits`, else the logit of vLLM's one-label
    sigmoid `probs`. Only finite numbers are scores, and a probability only within [0, 1] (the
    ends map to the largest finite logits); anything else raises ValueError."""
    if "logits" in d:
        return _finite_number(d["logits"][0], "logits[0]")
    p = _finite_number(d["probs"][0], "probs[0]")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"probs[0] is {p!r}, outside [0, 1]")
    p = min(max(p, 1e-12), 1 - 1e-12)
    return math.log(p / (1 - p))


class InProcessScorer:
    """The reward model in this process (one lock: calls take turns on the model)."""

    def __init__(self, directory: str | Path, device: str = "cpu") -> None:
        from slipstream.model.tokenizer import load_tokenizer
        from slipstream.rm.model import load_reward_model

        self.rm = load_reward_model(directory, device=device)
        self.tokenizer = load_tokenizer(directory)
        self._lock = threading.Lock()

    def score(self, texts: list[str]) -> list[float]:
        from slipstream.rm.model import score_ids

        seqs = [self.tokenizer.encode_prompt(t) for t in texts]
        with self._lock:
            return score_ids(self.rm, seqs, self.tokenizer.pad_id)

    def close(self) -> None:
        pass


class _Call:
    def __init__(self, text: str) -> None:
        self.text = text
        self.done = threading.Event()
        self.result: float | None = None
        self.error: BaseException | None = None


class BatchingScorer:
    """Coalesces concurrent single-text requests into calls of at most `max_batch` texts. The
    first waiter of a batch becomes its leader: it waits up to `window_s` for company, takes
    the queue (up to max_batch) and makes the call; the others wait for their results, at most
    `timeout_s` past the leader's call (then ServiceUnavailable)."""

    def __init__(self, inner: Scorer, max_batch: int, window_s: float, timeout_s: float) -> None:
        self.inner = inner
        self.max_batch = max_batch
        self.window_s = window_s
        self.timeout_s = timeout_s
        self._lock = threading.Condition()
        self._queue: list[_Call] = []
        self._leader = False
        self.calls = 0
        self.texts = 0

    def score_one(self, text: str) -> float:
        call = _Call(text)
        with self._lock:
            self._queue.append(call)
            lead = not self._leader
            if lead:
                self._leader = True
            elif len(self._queue) >= self.max_batch:
                self._lock.notify_all()
        if lead:
            self._lead()
        if not call.done.wait(self.timeout_s * 2 + self.window_s):
            raise ServiceUnavailable(f"no reward-model score within {self.timeout_s * 2:g} s")
        if isinstance(call.error, ServiceUnavailable):
            raise ServiceUnavailable(str(call.error)) from call.error
        if call.error is not None:  # a bug, not an outage: the group fails loudly
            raise RuntimeError(f"reward-model scoring failed: {call.error!r}") from call.error
        assert call.result is not None
        return call.result

    def _lead(self) -> None:
        deadline = time.monotonic() + self.window_s
        with self._lock:
            while len(self._queue) < self.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
        while True:
            with self._lock:
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
                if not batch:
                    self._leader = False
                    return
            try:
                scores = self.inner.score([c.text for c in batch])
                for c, s in zip(batch, scores, strict=True):
                    c.result = s
            except Exception as e:  # noqa: BLE001 - every waiter gets the call's failure, never a reward
                for c in batch:
                    c.error = e
            self.calls += 1
            self.texts += len(batch)
            for c in batch:
                c.done.set()

    def close(self) -> None:
        self.inner.close()


class RewardModelScorer:
    """The "reward_model" kind of `[[reward.functions]]`: sigmoid(score of task.prompt +
    completion), with the raw score in the reason. ServiceUnavailable when the model cannot
    answer (the group is requeued, never rewarded). `scorer`: the batching client."""

    def __init__(self, scorer: BatchingScorer) -> None:
        self.scorer = scorer

    def __call__(self, task: Task, completion: str) -> tuple[float, str]:
        raw = self.scorer.score_one(task.prompt + completion)
        return sigmoid(raw), f"score={raw:.4f}"


def reward_model_dir(cfg: SlipstreamConfig) -> Path:
    return (
        Path(cfg.reward.model)
        if cfg.reward.model
        else Path(cfg.run.output_dir) / "rm" / "checkpoint"
    )


def reward_summary(cfg: SlipstreamConfig) -> dict[str, Any]:
    """The report lines of a run rewarded by a reward model: the source, and the model's held-out
    pairwise accuracy when its rm_summary.json is readable here."""
    import json

    rc = cfg.reward
    out: dict[str, Any] = {}
    if rc.source != "verifier":  # the shorthand the config used
        out["reward source"] = rc.source if rc.source != "combined" else f"combined ({rc.combine})"
    out["reward functions"] = ", ".join(
        f"{f.name} ({f.kind}{', gated by ' + f.gate if f.gate else ''}) x {f.weight:g}"
        for f in rc.functions
    )
    if not rc.uses_reward_model():
        out["batch reward is"] = "the weighted sum of the reward functions (docs/rewards.md)"
        return out
    out["reward model"] = rc.url or str(reward_model_dir(cfg))
    summary = reward_model_dir(cfg) / "rm_summary.json"
    if not rc.url and summary.is_file():
        data = json.loads(summary.read_text())
        out["RM held-out pairwise accuracy"] = data.get("heldout_accuracy")
        out["RM held-out pairs"] = data.get("heldout_pairs")
    out["batch reward is"] = "sigmoid(RM score); held-out pass@1 is the task's verifier"
    return out


def make_reward_source(cfg: SlipstreamConfig, verifier: Verifier) -> Verifier:
    """The worker's Verifier per `[reward]`: `verifier` itself when the reward is the task's
    verifier alone (the default), else a `RewardSet` over `reward.functions` with the verifier
    and (when a function is one) the reward model, scored through reward.url or in-process
    (reward.model). The RewardSet owns `verifier` (closes it)."""
    from slipstream.rewards.rewardset import RewardSet

    rc = cfg.reward
    if rc.verifier_only():
        return verifier
    local: dict[str, Callable[[Task, str], tuple[float, str]]] = {"verifier": verifier.verify}
    closers: list[Callable[[], None]] = []
    if rc.uses_reward_model():
        scorer: Scorer
        if rc.url:
            import os

            scorer = HTTPScorer(rc.url, rc.timeout_s, os.environ.get("SLIPSTREAM_API_KEY"))
        else:
            directory = reward_model_dir(cfg)
            if not (directory / "config.json").is_file():
                raise FileNotFoundError(f"reward.functions has a 'reward_model': no reward model "
                                        f"at {directory} (train one with `slipstream rm train`, "
                                        "or set reward.model / reward.url)")  # fmt: skip
            scorer = InProcessScorer(directory)
        batching = BatchingScorer(scorer, rc.max_batch, rc.batch_window_s, rc.timeout_s)
        local["reward_model"] = RewardModelScorer(batching)
        closers.append(batching.close)
    closers.append(verifier.close)
    return RewardSet(rc, local, sandboxes=verifier.sandboxes, closers=closers)


def score_pairs(cfg: SlipstreamConfig,
                pairs: list[tuple[Task, str]]) -> list[dict[str, float | None | str]]:  # fmt: skip
    """`slipstream task check`: each `reward.functions` entry's result for every (task,
    completion) pair, by function name: a score, None (not applicable) or "error: <what>" (one
    call, no retries; a group function scores each completion as a group of 1; a gate is not
    applied). The verifier, reward model and reward processes are made here and closed."""
    from slipstream.rewards.rewardset import RewardSet
    from slipstream.rl.verifier import make_verifier
    from slipstream.tasks import get_taskset

    verifier = make_verifier(cfg.sandbox, get_taskset(cfg.task))
    try:
        source = make_reward_source(cfg, verifier)
    except BaseException:
        verifier.close()
        raise
    reward_set = (source if isinstance(source, RewardSet)  # the verifier alone otherwise
                  else RewardSet(cfg.reward, {"verifier": verifier.verify},
                                 closers=[verifier.close]))  # fmt: skip
    try:
        return [reward_set.check(task, text) for task, text in pairs]
    finally:
        reward_set.close()
