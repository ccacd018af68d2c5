"""Following the config from `run_job` (issue 33, "back and forth on the main path"): in a tiny
sync job in this process, the calls that pass the config (or one of its sections) on enter
rl/trainer.py and rl/controller.py at most 3 times each, counted as distinct call edges from
another file. A profile hook records them; the job itself is the real one."""

from __future__ import annotations

import sys
import threading
from collections import defaultdict
from pathlib import Path
from types import FrameType
from typing import Any

import slipstream
from jobutil import TINY_MODEL, save_random_init
from slipstream.config import load_config
from slipstream.config.base import Section
from slipstream.launch.job import run_job

SRC = str(Path(slipstream.__file__).parent) + "/"
MAX_ENTRIES = 3


def _carries_config(frame: FrameType) -> bool:
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    return any(isinstance(frame.f_locals.get(n), Section) for n in names)


def test_the_config_enters_trainer_and_controller_at_most_three_times(tmp_path: Path) -> None:
    args = [*TINY_MODEL, "trainer.mode=sync", "trainer.steps=2", "trainer.checkpoint_every=0",
            "trainer.groups_per_step=2", "rollout.group_size=2", "rollout.num_workers=1"]  # fmt: skip
    save_random_init(tmp_path / "init", args)
    cfg = load_config(None, [*args, f"run.output_dir={tmp_path / 'out'}",
                             f"model.init_from={tmp_path / 'init'}"])  # fmt: skip
    entries: dict[str, set[tuple[str, str, str]]] = defaultdict(set)
    lock = threading.Lock()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(SRC):
            return
        caller = frame.f_back
        if caller is None or caller.f_code.co_filename == frame.f_code.co_filename:
            return
        if not caller.f_code.co_filename.startswith(SRC) or not _carries_config(frame):
            return
        edge = (caller.f_code.co_filename[len(SRC) :], caller.f_code.co_qualname,
                frame.f_code.co_qualname)  # fmt: skip
        with lock:
            entries[frame.f_code.co_filename[len(SRC) :]].add(edge)

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        result = run_job(cfg, display=False)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert result.steps == 2
    assert entries["rl/controller.py"] and entries["rl/trainer.py"]  # the hook saw the path
    for path in ("rl/trainer.py", "rl/controller.py"):
        assert len(entries[path]) <= MAX_ENTRIES, sorted(entries[path])
