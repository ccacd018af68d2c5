"""[[reward.functions]] against real reward processes: what TRL-signature functions receive, the
weighted sum, group functions, and every hostile function (raises, hangs, NaN, a string, the wrong
length, os._exit, unbounded allocation, an import error) ending as a counted drop or a one-line
error, never a reward; the pool survives each. The functions are in tests/reward_fns.py."""

from __future__ import annotations

import logging
import time

import pytest

from slipstream.config import ConfigError, load_config
from slipstream.config.rm import RewardConfig
from slipstream.envs.base import RewardDropped
from slipstream.envs.single_turn import taskset_scorer
from slipstream.rewards.metrics import component_metrics, worker_error_totals
from slipstream.rewards.pool import CallFailed, FunctionSpec, RewardPool
from slipstream.rewards.rewardset import RewardSet
from slipstream.tasks import Task, get_taskset


def fn(name: str, function: str = "", **kw):  # type: ignore[no-untyped-def]
    entry = {"name": name, "kind": "python", "function": f"reward_fns:{function or name}"}
    return {**entry, **kw}


@pytest.fixture(scope="module")
def pool():  # type: ignore[no-untyped-def]
    """One pool of reward processes for the module (starting processes is the slow part)."""
    p = RewardPool(2, 1 << 30)
    yield p
    p.close()


def reward_set(pool, *functions, **cfg):  # type: ignore[no-untyped-def]
    rc = RewardConfig.model_validate({"functions": list(functions), **cfg})
    return RewardSet(rc, pool=pool)


@pytest.fixture(scope="module")
def arith():  # type: ignore[no-untyped-def]
    return get_taskset(load_config(None, ["task.name=arithmetic"]).task)


def dataset_task(prompt) -> Task:  # type: ignore[no-untyped-def]
    """A dataset row as the data side builds it (meta: prompt, answer, columns)."""
    return Task("dataset/train/0", "Q: 1/2 + 1/4?", "k0", {
        "prompt": prompt, "answer": "3/4",
        "columns": {"solution": "3/4", "data_source": "toy", "extra_info": {"level": 2}},
    })  # fmt: skip


def test_trl_signature_columns_weights_and_message_prompts(pool) -> None:  # type: ignore[no-untyped-def]
    rs = reward_set(pool, fn("contains", "contains_answer", weight=2.0), fn("cols", "echo_columns"),
                    fn("len", "length_reward", weight=0.0), fn("na", "not_applicable"),
                    fn("one", "per_sample", batched=False), fn("aw", "async_reward"),
                    {"name": "e", "kind": "exact", "answer_key": "solution"})  # fmt: skip
    try:
        # contains_answer reads `answer`: no such column here -> a TypeError, so map it
        task = dataset_task("Q: 1/2 + 1/4?")
        task.meta["columns"]["answer"] = "3/4"
        s = rs.verify(task, "it is 3/4")
        assert s.components == {"contains": 1.0, "cols": 1.0, "len": pytest.approx(1 / 10),
                                "na": None, "one": 1.0, "aw": 0.5, "e": 0.0}  # fmt: skip
        assert s.reward == pytest.approx(2.0 + 1.0 + 0 + 1.0 + 0.5)
        assert rs.verify(task, " 3/4. ").components["e"] == 1.0  # normalised
        # conversational prompt: completions reach the function as TRL passes them
        chat = dataset_task([{"role": "user", "content": "1/2 + 1/4?"}])
        chat.meta["columns"]["answer"] = "3/4"
        assert rs.verify(chat, "3/4").components["contains"] == 1.0
    finally:
        rs.close()


def test_builtin_task_gets_its_answer_as_a_column(arith, pool) -> None:  # type: ignore[no-untyped-def]
    rc = RewardConfig.model_validate({"workers": 1, "functions": [
        {"name": "verifier", "kind": "verifier", "weight": 0.5},
        {"name": "exact", "kind": "exact"},
        {"name": "regex", "kind": "regex", "pattern": r"(-?\d+)\s*$"},
        fn("contains", "contains_answer"),
    ]})  # fmt: skip
    rs = RewardSet(rc, {"verifier": taskset_scorer(arith)}, pool=pool)
    try:
        task = arith.train(0)
        right = arith.demonstration(task)
        assert rs.verify(task, right)[0] == 3.5
        assert rs.verify(task, "no").components == {"verifier": 0.0, "exact": 0.0, "regex": 0.0,
                                                    "contains": 0.0}  # fmt: skip
        assert rs.check(task, right) == {"verifier": 1.0, "exact": 1.0, "regex": 1.0,
                                         "contains": 1.0}  # fmt: skip
    finally:
        rs.close()


def test_group_function_scores_the_whole_group(pool) -> None:  # type: ignore[no-untyped-def]
    rs = reward_set(pool, fn("short", "rank_in_group", group=True), fn("len", "length_reward"))
    try:
        task = dataset_task("q")
        assert [s.components for s in rs.score_group(task, ["aa", "a", "aaa"])] == [
            {"short": 0.0}, {"short": 1.0}, {"short": 0.0}]  # fmt: skip
        assert set(rs.verify(task, "a").components) == {"len"}  # group ones are not per sample
    finally:
        rs.close()


HOSTILE = [
    ("raises", "error", "ZeroDivisionError: the user's bug"),
    ("returns_nan", "invalid", "returned nan, not a finite number"),
    ("returns_string", "invalid", "returned str '1.0', not a number"),
    ("returns_bool", "invalid", "returned bool True, not a number"),
    ("wrong_length", "invalid", "returned 2 rewards for 1 completions"),
    ("exits", "crash", "the reward process died (exit code 3)"),
]


@pytest.mark.parametrize(("function", "kind", "message"), HOSTILE)
def test_hostile_function_is_a_counted_drop_never_a_reward(
    pool, function, kind, message, caplog
) -> None:  # type: ignore[no-untyped-def]
    rs = reward_set(pool, fn("bad", function), fn("good", "length_reward"), retries=1)
    task = dataset_task("q")
    try:
        with caplog.at_level(logging.ERROR, logger="slipstream.rewards.rewardset"):
            for _ in range(2):
                with pytest.raises(RewardDropped, match="reward function 'bad' gave no reward"
                                   ) as e:  # fmt: skip
                    rs.verify(task, "x")
                assert message in str(e.value) and not e.value.fatal
        logged = [r for r in caplog.records if "'bad'" in r.getMessage()]
        assert len(logged) == 1 and message in logged[0].getMessage()  # once, with an example
        assert "completion: 'x'" in logged[0].getMessage()
        st = rs.reward_stats()
        assert st["reward_bad_failed_calls"] == 4 and st["reward_bad_dropped"] == 2
        assert st["reward_bad_scores"] == 0  # nothing of it became a reward
        assert worker_error_totals({"w0": st}) == {"reward/bad/failed_calls": 4.0,
                                                   "reward/bad/dropped": 2.0,
                                                   "reward/good/failed_calls": 0.0,
                                                   "reward/good/dropped": 0.0}  # fmt: skip
        # the pool survives: a good function still scores, in every process
        good = reward_set(pool, fn("good", "length_reward"))
        for _ in range(3):
            assert good.verify(task, "abc").components == {"good": 0.25}
    finally:
        rs.close()


def test_hung_call_is_killed_and_replaced_within_its_timeout() -> None:
    pool = RewardPool(1, 1 << 30)
    try:
        spec = FunctionSpec("python", "reward_fns:hangs")
        before = pool.pids()
        t0 = time.monotonic()
        with pytest.raises(CallFailed, match="no answer within 0.5 s"):
            pool.call(spec, {"prompts": ["q"], "completions": ["x"]}, 1, 0.5)
        assert time.monotonic() - t0 < 3.0
        assert pool.pids() != before and pool.replaced == 1
        ok = FunctionSpec("python", "reward_fns:length_reward")
        assert pool.call(ok, {"prompts": ["q"], "completions": ["abc"]}, 1, 30.0) == [0.25]
    finally:
        pool.close()


def test_unbounded_allocation_fails_under_the_memory_limit() -> None:
    pool = RewardPool(1, 512 << 20)
    try:
        spec = FunctionSpec("python", "reward_fns:allocates")
        with pytest.raises(CallFailed, match="MemoryError"):
            pool.call(spec, {"prompts": ["q"], "completions": ["x"]}, 1, 30.0)
        ok = FunctionSpec("python", "reward_fns:length_reward")
        assert pool.call(ok, {"prompts": ["q"], "completions": ["a"]}, 1, 30.0) == [0.5]
    finally:
        pool.close()


def test_consecutive_failures_stop_with_one_line_naming_the_function(pool) -> None:  # type: ignore[no-untyped-def]
    rs = reward_set(pool, fn("bad", "raises"), retries=2, max_consecutive_failures=5)
    try:
        task = dataset_task("q")
        with pytest.raises(RewardDropped) as first:
            rs.verify(task, "x")  # 3 failed calls: dropped, not fatal yet
        assert not first.value.fatal
        with pytest.raises(RewardDropped) as second:
            rs.verify(task, "x")  # calls 4 and 5
        assert second.value.fatal == (
            "reward function 'bad' failed on 5 consecutive calls "
            "(reward.max_consecutive_failures); last: ZeroDivisionError: the user's bug"
        )
        assert "\n" not in second.value.fatal
    finally:
        rs.close()


def test_a_retry_that_succeeds_is_a_reward(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SLIPSTREAM_TEST_FLAKY_DIR", str(tmp_path))  # the new process reads it
    rs = RewardSet(RewardConfig.model_validate({"functions": [fn("flaky")], "workers": 1,
                                                "retries": 1}))  # fmt: skip
    try:
        assert rs.verify(dataset_task("q"), "x").components == {"flaky": 1.0}
        assert rs.reward_stats()["reward_flaky_failed_calls"] == 1
    finally:
        rs.close()


def test_import_error_names_the_module_at_start(pool) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=r"reward function 'r' \(python no_such_mod:f\): "
                       r"ModuleNotFoundError: No module named 'no_such_mod'"):  # fmt: skip
        reward_set(pool, {"name": "r", "kind": "python", "function": "no_such_mod:f"})
    with pytest.raises(ValueError, match="module 'reward_fns' has no attribute 'nope'"):
        reward_set(pool, fn("r", "nope"))


def test_config_errors_are_one_line() -> None:
    bad = [
        (["reward.url=ftp://host/x"], r"'ftp://host/x' is not an http\(s\)://host"),
        (["reward.url=file:///tmp/rm"], r"'file:///tmp/rm' is not an http\(s\)://host"),
    ]
    for overrides, match in bad:
        with pytest.raises(ConfigError, match=match):
            load_config(None, overrides)
    for functions, match in [
        ([{"name": "p", "kind": "python"}], "needs function = 'package.module:name'"),
        ([{"name": "p", "kind": "python", "function": "not a path"}], "is not 'package.module"),
        ([{"name": "r", "kind": "regex", "pattern": "\\d+"}], "has no capture group"),
        ([{"name": "r", "kind": "regex", "pattern": "(("}], "pattern '\\(\\(':"),
        ([{"name": "a", "kind": "exact"}, {"name": "a", "kind": "math"}], "'a' is used twice"),
        ([{"name": "a", "kind": "exact", "gate": "zz"}], "gate 'zz' must name another"),
        ([{"name": "a", "kind": "exact", "group": True}], "are for kind = 'python'"),
    ]:
        with pytest.raises(ValueError, match=match):
            RewardConfig.model_validate({"functions": functions})
    with pytest.raises(ValueError, match="shorthand of reward.functions"):
        RewardConfig.model_validate({"source": "reward_model",
                                     "functions": [{"name": "m", "kind": "math"}]})  # fmt: skip


def test_legacy_keys_resolve_to_functions_and_round_trip() -> None:
    cfg = load_config("configs/rlhf.toml")
    assert [(f.name, f.kind, f.weight) for f in cfg.reward.functions] == [
        ("verifier", "verifier", 0.0), ("reward_model", "reward_model", 1.0)]  # fmt: skip
    again = type(cfg).model_validate(cfg.model_dump())  # what the workers load
    assert again.reward == cfg.reward and again.reward.uses_reward_model()
    assert load_config(None, []).reward.verifier_only()


def test_component_metrics() -> None:
    class S:
        def __init__(self, c):  # type: ignore[no-untyped-def]
            self.reward_components = c

    m = component_metrics([S({"a": 1.0, "b": None}), S({"a": 0.0, "b": None}), S({})])
    assert m["reward/a/mean"] == 0.5 and m["reward/a/none"] == 0.0
    assert m["reward/b/none"] == 1.0 and m["reward/b/mean"] != m["reward/b/mean"]  # NaN


def test_report_draws_the_components(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from slipstream.observe.report import plot_reward_components, write_report

    records = [{"step": i, "reward_mean": 0.5, "reward/math/mean": 0.1 * i, "reward/math/none": 0.0,
                "reward/fmt/mean": None, "reward/fmt/none": 1.0, "reward/fmt/failed_calls": i,
                "reward/fmt/dropped": 0.0} for i in range(1, 6)]  # fmt: skip
    report = write_report(tmp_path, {"steps": 5}, records).read_text()
    assert "![reward components](reward_components.png)" in report
    assert (tmp_path / "reward_components.png").stat().st_size > 0
    assert plot_reward_components([{"step": 1, "reward_mean": 1.0}], tmp_path / "n.png") is None


def test_close_ends_calls_waiting_for_a_process() -> None:
    import threading

    pool = RewardPool(1, 1 << 30)
    hang = FunctionSpec("python", "reward_fns:hangs")
    errors: list[str] = []

    def call() -> None:
        try:
            pool.call(hang, {"prompts": ["q"], "completions": ["x"]}, 1, 60.0)
        except CallFailed as e:
            errors.append(e.kind)

    threads = [threading.Thread(target=call) for _ in range(2)]  # one runs, one waits
    for t in threads:
        t.start()
    pool.close()  # whenever it comes: a call running, waiting, or not yet started
    for t in threads:
        t.join(10.0)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 2 and set(errors) <= {"crash", "error"}
