"""Restart policy of the launchers: lost workers are replaced at once, start failures back off
and then fail the job; Coordinator.fail wakes a waiting trainer with the reason."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from slipstream.launch.supervise import RestartPolicy, crash_loop_message, log_tail
from slipstream.rl.buffer import ExperienceBuffer
from slipstream.rl.coordinator import Coordinator
from slipstream.rl.queue import TaskQueue
from slipstream.rl.types import RolloutFailed


def test_start_failures_back_off_then_give_up_and_a_started_worker_resets() -> None:
    policy = RestartPolicy(max_start_failures=4, backoff_s=1.0, backoff_max_s=3.0)
    assert [policy.delay_s(0, False) for _ in range(3)] == [1.0, 2.0, 3.0]
    assert policy.delay_s(1, False) == 1.0  # slots count separately
    assert policy.delay_s(0, True) == 0.0  # it reached the coordinator: a loss, not a crash loop
    assert [policy.delay_s(0, False) for _ in range(4)] == [1.0, 2.0, 3.0, None]
    assert policy.delay_s(0, True) == 0.0  # killed after it started: always replaced
    assert all(policy.delay_s(0, True) == 0.0 for _ in range(50))


def test_schedule_holds_a_slot_until_its_backoff_is_over() -> None:
    policy = RestartPolicy(max_start_failures=2, backoff_s=5.0, backoff_max_s=30.0)
    assert policy.schedule(0, False, now_s=100.0) == 5.0 and policy.waiting(0)
    assert policy.schedule(1, True, now_s=100.0) == 0.0
    assert policy.due(100.0) == [1] and policy.due(104.9) == []
    assert policy.due(105.0) == [0] and not policy.waiting(0) and policy.due(200.0) == []
    assert policy.schedule(0, False, now_s=300.0) is None and not policy.waiting(0)


def test_crash_loop_message_names_the_slot_and_ends_with_the_output(tmp_path: Path) -> None:
    log = tmp_path / "w0.4.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)) + "ImportError: no engine\n")
    msg = crash_loop_message(0, "w0.4", 1, 5, log_tail(log, max_bytes=200))
    assert "slot 0 failed to start 5 times in a row" in msg and "w0.4, exit 1" in msg
    assert msg.endswith("  | ImportError: no engine") and "line 0\n" not in msg
    assert log_tail(tmp_path / "missing.log") == ""
    assert "(no output)" in crash_loop_message(0, "w0.0", None, 5, "")


def test_fail_wakes_the_waiting_trainer_with_the_reason() -> None:
    coord = Coordinator(TaskQueue(10), ExperienceBuffer(2, 0))
    assert not coord.reached("w0.0")
    assert coord.lease("w0.0", 1, 10.0) is not None and coord.reached("w0.0")
    raised: list[BaseException] = []

    def trainer() -> None:
        try:
            coord.get_batch(2, timeout_s=60)
        except RolloutFailed as e:
            raised.append(e)

    t = threading.Thread(target=trainer)
    t.start()
    time.sleep(0.2)
    coord.fail("slot 0 crash-loops")
    t.join(timeout=5)
    assert not t.is_alive() and str(raised[0]) == "slot 0 crash-loops"
    assert coord.stopping() and coord.lease("w1.0", 1, 10.0) is None
    with pytest.raises(RolloutFailed):
        coord.get_batch(2, timeout_s=0)
