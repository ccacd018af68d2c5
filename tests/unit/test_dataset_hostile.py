"""Hostile data files: each is a one-line DataError naming the file (and row, column), or a
counted skip; never a traceback. And reading stays bounded: a window of blocks, not the file."""

from __future__ import annotations

import json
import tracemalloc

import fsspec.implementations.local
import pytest

from slipstream.cli import main
from slipstream.config import load_config
from slipstream.tasks import get_taskset
from slipstream.tasks.datafiles import DataError


def load(*overrides: str):
    cfg = load_config(None, ["task.name=dataset", "task.num_heldout=2", *overrides])
    return get_taskset(cfg.task)


def error_of(*overrides: str) -> str:
    with pytest.raises(DataError) as info:
        load(*overrides)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_missing_prompt_column_names_file_row_and_column(tmp_path) -> None:
    path = jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"answer": "3"}])
    message = error_of(f"task.train_files=['{path}']", "task.layout=trl")
    assert message.startswith(f"{path}:2: no column 'prompt'") and "answer" in message
    missing = error_of(f"task.train_files=['{path}']", "task.answer_key=gold")
    assert missing == f"{path}:1: no column 'gold' (task.answer_key)"


def test_no_recognisable_layout(tmp_path) -> None:
    path = jsonl(tmp_path / "d.jsonl", [{"text": "hi"}])
    assert "no prompt column found among ['text']" in error_of(f"task.train_files=['{path}']")


@pytest.mark.parametrize("prompt", [17, None, {"role": "user"}, [], [{"role": "user"}], ["hi"]])
def test_wrong_prompt_type(tmp_path, prompt) -> None:
    path = jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": prompt}])
    message = error_of(f"task.train_files=['{path}']")
    assert message.startswith(f"{path}:2: column 'prompt': a ")


def test_a_row_that_is_not_an_object_or_not_json(tmp_path) -> None:
    path = jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, "[1, 2]"])
    assert error_of(f"task.train_files=['{path}']") == (
        f"{path}:2: a row must be a JSON object, got list"
    )
    path = jsonl(tmp_path / "e.jsonl", [{"prompt": "a"}, '{"prompt": '])
    assert error_of(f"task.train_files=['{path}']").startswith(f"{path}:2: not valid JSON")


def test_empty_file(tmp_path) -> None:
    for name, text in [("e.jsonl", ""), ("blank.jsonl", "\n\n  \n"), ("e.csv", ""),
                       ("h.csv", "prompt,answer\n")]:  # fmt: skip
        (tmp_path / name).write_text(text)
        message = error_of(f"task.train_files=['{tmp_path / name}']")
        assert message == f"{tmp_path / name}: empty file (no rows)"


def test_not_utf8(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    assert error_of(f"task.train_files=['{path}']") == (f"{path}:2: not UTF-8 (byte 15 of the row)")


def test_glob_matching_nothing_and_missing_file(tmp_path) -> None:
    assert error_of(f"task.train_files=['{tmp_path}/*.parquet']") == (
        f"task.train_files[0] = '{tmp_path}/*.parquet': the glob matches no file"
    )
    missing = error_of(f"task.train_files=['{tmp_path}/y.jsonl']")
    assert missing == f"task.train_files[0] = '{tmp_path}/y.jsonl': no such file"
    (tmp_path / "d.txt").write_text("x")
    assert "unknown format '.txt'" in error_of(f"task.train_files=['{tmp_path}/d.txt']")


def test_unreadable_file(tmp_path, monkeypatch) -> None:
    path = jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}])

    # The tests run as root here, where chmod 000 does not stop a read: the filesystem answers
    # as the kernel does for a file the user may not read.
    def denied(self, p, mode="rb", **kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(fsspec.implementations.local.LocalFileSystem, "_open", denied)
    assert error_of(f"task.train_files=['{path}']") == (
        f"{path}: permission denied (cannot read the file)"
    )


def test_not_a_parquet_file(tmp_path) -> None:
    (tmp_path / "d.parquet").write_text('{"prompt": "a"}\n')
    assert error_of(f"task.train_files=['{tmp_path}/d.parquet']").startswith(
        f"{tmp_path}/d.parquet: not a Parquet file: "
    )


def test_overlong_prompts_are_skipped_and_counted_or_an_error(tmp_path, caplog) -> None:
    rows = [{"prompt": "1+1=", "answer": "2"}] * 3 + [{"prompt": "9" * 100, "answer": "9"}] * 2
    path = jsonl(tmp_path / "d.jsonl", rows)
    files = (f"task.train_files=['{path}']", f"task.heldout_files=['{path}']")
    ts = load(*files, "task.max_prompt_tokens=20")
    st = ts.stats()[0]
    assert (st.rows, st.train, st.skipped_overlong, st.longest_skipped) == (5, 3, 2, 101)
    assert all(ts.train(i).prompt == "1+1=" for i in range(10))
    assert "2 of 5 rows skipped: prompt longer than task.max_prompt_tokens = 20" in caplog.text
    assert error_of(*files, "task.max_prompt_tokens=20", "task.overlong=error") == (
        f"{path}:4: the prompt is 101 tokens, longer than task.max_prompt_tokens = 20 "
        "(task.overlong = 'skip' skips such rows)"
    )
    # The default limit is the model's context minus the completion cap, resolved at load.
    cfg = load_config(None, ["task.name=dataset", *files, "model.max_position_embeddings=64",
                             "engine.max_new_tokens=16"])  # fmt: skip
    assert cfg.task.max_prompt_tokens == 48


def test_unencodable_prompt_names_the_row(tmp_path) -> None:
    path = jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1="}, {"prompt": "caf\u00e9"}])
    message = error_of(f"task.train_files=['{path}']")
    assert message.startswith(f"{path}:2: the prompt cannot be tokenised: CharTokenizer")


def test_cli_prints_one_line_not_a_traceback(tmp_path, capsys) -> None:
    path = jsonl(tmp_path / "d.jsonl", [{"answer": "2"}])
    rc = main(["task", "check", "--task.name=dataset", f"--task.train_files=['{path}']"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert (
        err.strip()
        .splitlines()[-1]
        .endswith(
            f"{path}:1: no prompt column found among ['answer']: expected 'prompt' (TRL, verl), "
            "'input' (OpenRLHF, slime) or 'question'; or set task.prompt_key"
        )
    )


def test_reading_is_bounded_by_the_shuffle_window(tmp_path) -> None:
    """4,000 rows of ~2 KB (8 MB): a pass through a 512-row window allocates a small
    fraction of the file at its peak, and the block cache holds a window's blocks, not the file."""
    pad = "x" * 2000
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        for i in range(4_000):
            f.write(json.dumps({"prompt": f"{i}=", "answer": str(i), "pad": pad}) + "\n")
    ts = load(f"task.train_files=['{path}']", "task.shuffle_buffer=512", "task.block_rows=128",
              f"task.heldout_files=['{path}']")  # fmt: skip
    src = ts.sources[0]
    tracemalloc.start()
    try:
        for i in range(0, 4_000, 3):
            ts.train(i)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(src._block_cache) <= 2 * (512 // 128) + 2
    assert peak < 5 << 20, f"peak {peak / 2**20:.1f} MiB while reading an 8 MB file"
