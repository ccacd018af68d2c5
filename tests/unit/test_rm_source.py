"""The reward source in-process: concurrent completions from many threads are coalesced into
calls of at most max_batch and each gets its own score; the combined rules; a reward model that
is gone is ServiceUnavailable for every waiter, never a score."""

import threading

import pytest
import torch

from slipstream.config import load_config
from slipstream.envs import ServiceUnavailable
from slipstream.rewards.rewardset import RewardSet
from slipstream.rl.verifier import InProcessVerifier
from slipstream.rm.model import MoERewardModel, save_reward_model
from slipstream.rm.source import (
    BatchingScorer,
    HTTPScorer,
    InProcessScorer,
    make_reward_source,
    sigmoid,
)
from slipstream.tasks import get_taskset

TINY = ["model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2",
        "model.num_key_value_heads=1", "model.head_dim=16", "model.moe_intermediate_size=16",
        "model.num_experts=4", "task.name=arithmetic"]  # fmt: skip


@pytest.fixture
def rm_dir(tmp_path):
    cfg = load_config(None, TINY)
    tok = get_taskset(cfg.task).tokenizer
    torch.manual_seed(0)
    rm = MoERewardModel(cfg.model.model_copy(update={"vocab_size": tok.vocab_size})).eval()
    return save_reward_model(rm, tmp_path / "rm", tok)


def test_concurrent_texts_are_batched_and_each_gets_its_score(rm_dir):
    inner = InProcessScorer(rm_dir)
    texts = [f"{i}+{i}={2 * i}" for i in range(40)]
    want = inner.score(texts)
    scorer = BatchingScorer(inner, max_batch=8, window_s=0.05, timeout_s=30)
    got = [0.0] * len(texts)
    start = threading.Barrier(len(texts))

    def one(i):
        start.wait()
        got[i] = scorer.score_one(texts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == pytest.approx(want, abs=1e-5)
    assert scorer.texts == 40 and 5 <= scorer.calls < 40  # <= 8 per call, several per call


def test_combined_sum_and_gate(rm_dir, tmp_path):
    cfg = load_config(None, [*TINY, f"run.output_dir={tmp_path}", f"reward.model={rm_dir}",
                             "reward.source=combined", "reward.verifier_weight=0.25",
                             "reward.rm_weight=0.75"])  # fmt: skip
    taskset = get_taskset(cfg.task)
    task = taskset.train(0)
    right, wrong = taskset.demonstration(task), "x"
    raw = InProcessScorer(rm_dir).score([task.prompt + right])[0]
    v = make_reward_source(cfg, InProcessVerifier(taskset))
    assert isinstance(v, RewardSet)  # the shorthand is a case of [[reward.functions]]
    assert [(f.name, f.weight) for f in cfg.reward.functions] == [
        ("verifier", 0.25),
        ("reward_model", 0.75),
    ]
    verdict = taskset.verify(task, right).reward
    score = v.verify(task, right)
    reward, reason = score
    assert reward == pytest.approx(0.25 * verdict + 0.75 * sigmoid(raw), abs=1e-6)
    assert reason.startswith(f"verifier={verdict:g} (correct) reward_model=")
    assert score.components == pytest.approx({"verifier": verdict, "reward_model": sigmoid(raw)})
    v.close()
    gate = load_config(None, [*TINY, f"run.output_dir={tmp_path}", f"reward.model={rm_dir}",
                              "reward.source=combined", "reward.combine=gate"])  # fmt: skip
    gated = make_reward_source(gate, InProcessVerifier(taskset))
    assert gated.verify(task, wrong) == (0.0, "verifier=0 (not an integer: 'x') "
                                              "reward_model=0 (gate verifier closed)")  # fmt: skip
    assert gated.verify(task, right)[0] == pytest.approx(sigmoid(raw), abs=1e-6)
    plain = InProcessVerifier(taskset)
    assert make_reward_source(load_config(None, TINY), plain) is plain  # the verifier alone


def test_unreachable_reward_model_is_never_a_score():
    # a port nobody listens on: connection refused, for every waiter of the batch
    scorer = BatchingScorer(HTTPScorer("http://127.0.0.1:9", 2.0), 8, 0.05, 2.0)
    errors = []

    def one():
        try:
            scorer.score_one("1+1=2")
        except ServiceUnavailable as e:
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 5 and all("reward model http://127.0.0.1:9" in str(e) for e in errors)


def test_missing_local_reward_model_names_the_path(tmp_path):
    cfg = load_config(None, [*TINY, f"run.output_dir={tmp_path}", "reward.source=reward_model"])
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "rm" / "checkpoint")):
        make_reward_source(cfg, InProcessVerifier(get_taskset(cfg.task)))


class _GarbageRM:
    """A real HTTP server on loopback answering every /classify with one fixed JSON body (raw
    text, so NaN and Infinity go out as Python's json writes them)."""

    def __init__(self, body: str) -> None:
        import http.server

        payload = body.encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(
    "item",
    [
        '{"index": 0, "logits": [NaN]}',
        '{"index": 0, "logits": [Infinity]}',
        '{"index": 0, "logits": [-Infinity]}',
        '{"index": 0, "logits": [1e400]}',
        '{"index": 0, "logits": ["1e400"]}',
        '{"index": 0, "logits": ["9"]}',
        '{"index": 0, "logits": [true]}',
        '{"index": 0, "logits": [null]}',
        '{"index": 0, "logits": []}',
        '{"index": 0, "probs": [2.0]}',
        '{"index": 0, "probs": [-0.5]}',
        '{"index": 0, "probs": [NaN]}',
        '{"index": 0, "probs": ["0.5"]}',
        '{"index": 0}',
    ],
)
def test_a_garbage_reward_model_answer_is_never_a_reward(item):
    # issue 44: NaN, infinities, strings, booleans and out-of-range probabilities were coerced
    # into rewards (Infinity -> 1.0, the maximum); each is an infrastructure failure instead
    server = _GarbageRM('{"data": [' + item + "]}")
    try:
        with pytest.raises(ServiceUnavailable, match="malformed answer"):
            HTTPScorer(server.url, 5.0).score(["1+1=2"])
    finally:
        server.close()


def test_a_finite_reward_model_answer_is_a_score():
    server = _GarbageRM('{"data": [{"index": 1, "probs": [0.5]}, {"index": 0, "logits": [-2]}]}')
    try:
        assert HTTPScorer(server.url, 5.0).score(["a", "b"]) == pytest.approx([-2.0, 0.0])
    finally:
        server.close()
