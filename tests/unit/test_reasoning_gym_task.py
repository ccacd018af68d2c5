"""`task.name = "reasoning_gym"`: seeded, weighted, disjoint splits, scored by score_answer."""

from __future__ import annotations

import collections

import pytest

from slipstream.config import ConfigError, load_config
from slipstream.tasks import get_taskset

pytest.importorskip("reasoning_gym")

GYM = """
[task]
name = "reasoning_gym"
num_heldout = 40
[[task.gym]]
name = "basic_arithmetic"
weight = 3.0
options = {min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 1}
[[task.gym]]
name = "spell_backward"
"""


def gym(tmp_path, text: str = GYM, *overrides: str):
    (tmp_path / "gym.toml").write_text(text)
    return get_taskset(load_config(tmp_path / "gym.toml", list(overrides)).task)


def test_mix_split_and_scores(tmp_path) -> None:
    import reasoning_gym

    ts = gym(tmp_path)
    train = [ts.train(i) for i in range(200)]
    counts = collections.Counter(t.meta["gym"] for t in train)
    assert 0.6 < counts["basic_arithmetic"] / 200 < 0.9
    held = ts.heldout()
    assert len(held) == 40 and not {t.key for t in held} & {t.key for t in train}
    options = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    own = {"basic_arithmetic": reasoning_gym.create_dataset("basic_arithmetic", seed=1234, **options),
           "spell_backward": reasoning_gym.create_dataset("spell_backward", seed=1234)}  # fmt: skip
    for t in train[:20] + held[:20]:
        ds = own[t.meta["gym"]]
        entry = ds[t.meta["index"]]
        assert t.prompt == entry["question"] and t.meta["answer"] == entry["answer"]
        assert (
            ts.verify(t, ts.demonstration(t)).reward
            == ds.score_answer(entry["answer"], entry)
            == 1.0
        )
        assert ts.verify(t, "").reward == 0.0
        assert ts.verify(t, "\x00" * 10_000).reward == 0.0
    # The run's seed makes the stream: same seed, same tasks; another seed, others.
    again = gym(tmp_path)
    assert [again.train(i).key for i in range(50)] == [t.key for t in train[:50]]
    other = gym(tmp_path, GYM, "task.seed=9")
    assert [other.train(i).key for i in range(50)] != [t.key for t in train[:50]]


def test_bad_gym_entries_are_one_line_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"task.gym\[0\] \('no_such_task'\)"):
        gym(tmp_path, '[task]\nname = "reasoning_gym"\n[[task.gym]]\nname = "no_such_task"\n')
    with pytest.raises(ConfigError, match=r"task.gym\[0\] \('chain_sum'\)"):
        gym(tmp_path, '[task]\nname = "reasoning_gym"\n[[task.gym]]\nname = "chain_sum"\n'
                      'options = {bogus = 1}\n')  # fmt: skip
    with pytest.raises(ConfigError, match="needs at least one"):
        load_config(None, ["task.name=reasoning_gym"])


def test_demo_reversed_is_a_keyed_share_and_leaves_scoring_exact(tmp_path) -> None:
    """`task.demo_reversed`: the teacher writes a keyed share of the answers backwards (palindromes
    stay); the verifier still scores by score_answer, so those demonstrations score 0."""
    exact = gym(tmp_path)
    weak = gym(tmp_path, GYM, "task.demo_reversed=0.6")
    train = [weak.train(i) for i in range(400)]
    flipped = 0
    for t in train:
        answer, demo = t.meta["answer"], weak.demonstration(t)
        assert exact.demonstration(t) == answer == weak.reference(t)
        if answer == answer[::-1]:
            assert demo == answer
            continue
        if demo != answer:
            assert demo == answer[::-1] and weak.verify(t, demo).reward < 1.0
            flipped += 1
        assert weak.verify(t, answer).reward == 1.0
    asymmetric = sum(t.meta["answer"] != t.meta["answer"][::-1] for t in train)
    assert 0.5 < flipped / asymmetric < 0.7
    # Keyed by the problem: another task set of the same config gives the same demonstrations.
    again = gym(tmp_path, GYM, "task.demo_reversed=0.6")
    assert [again.demonstration(t) for t in train] == [weak.demonstration(t) for t in train]
