"""`task.name = "dataset"`: layouts, order, resume, splits, mixing, chat templates, SFT targets."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slipstream.config import load_config
from slipstream.model.tokenizer import CharTokenizer
from slipstream.rl.queue import TaskQueue
from slipstream.tasks import get_taskset
from slipstream.tasks.dataset import DatasetTaskSet

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _make_data():
    spec = importlib.util.spec_from_file_location("make_data", EXAMPLES / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data")
    _make_data().write(out, n=300)
    return out


def taskset(*overrides: str, tokenizer=None) -> DatasetTaskSet:
    cfg = load_config(None, ["task.name=dataset", "task.num_heldout=20", *overrides])
    ts = get_taskset(cfg.task, tokenizer)
    assert isinstance(ts, DatasetTaskSet)
    return ts


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("layout", ["trl", "verl", "openrlhf"])
def test_each_layout_loads_without_conversion(data_dir, layout, fmt) -> None:
    ts = taskset(f"task.train_files=['{data_dir}/{layout}.{fmt}']")
    task = ts.train(0)
    meta = task.meta
    prompt_text = (
        meta["prompt"] if isinstance(meta["prompt"], str) else meta["prompt"][0]["content"]
    )
    a, b = prompt_text.rstrip("=").split("+")
    assert meta["answer"] == str(int(a) + int(b))
    assert ts.verify(task, meta["answer"]).reward == 1.0
    assert ts.verify(task, "").reward == 0.0
    assert ts.demonstration(task) == meta["answer"]
    json.dumps(meta)  # queue snapshots and reward workers need JSON
    tok = ts.tokenizer
    if layout == "verl":
        assert meta["prompt"] == [{"role": "user", "content": prompt_text}]
        assert set(meta["columns"]) == {"data_source", "ability", "reward_model", "extra_info"}
        assert meta["columns"]["reward_model"]["ground_truth"] == meta["answer"]
        assert ts.prompt_ids(task) == tok.chat_prompt(meta["prompt"])
    elif layout == "trl":
        assert meta["columns"] == {"answer": meta["answer"], "difficulty": len(a) + len(b)}
        assert ts.prompt_ids(task) == [tok.bos_id, *tok.encode(prompt_text)]
    else:
        assert meta["columns"] == {"label": meta["answer"]}
    # The char template renders a user turn as its text: the same ids in every layout.
    assert ts.prompt_ids(task) == [tok.bos_id, *tok.encode(prompt_text)]
    st = ts.stats()[0]
    assert st.rows == 300 and st.train + st.heldout == 300 and st.skipped_overlong == 0


def test_order_is_a_pure_function_of_seed_and_index(data_dir) -> None:
    args = (
        f"task.train_files=['{data_dir}/trl.jsonl']",
        "task.shuffle_buffer=40",
        "task.block_rows=8",
    )
    one, two = taskset(*args), taskset(*args)
    n = one.sources[0].count_train
    forward = [one.train(i).key for i in range(3 * n)]
    backward = [two.train(i).key for i in reversed(range(3 * n))][::-1]
    assert forward == backward
    epochs = [forward[e * n : (e + 1) * n] for e in range(3)]
    assert all(len(set(e)) == n for e in epochs)  # each epoch is a permutation of the train rows
    assert set(epochs[0]) == set(epochs[1]) and epochs[0] != epochs[1]  # reshuffled per epoch
    other = taskset(*args, "task.seed=7")
    assert [other.train(i).key for i in range(n)] != epochs[0]
    # The shuffle spans blocks: the first window draws from more than one block of the file.
    origins = {int(one.train(i).meta["origin"].rsplit(":", 1)[1]) // 8 for i in range(40)}
    assert len(origins) > 2


def test_a_restored_queue_continues_the_same_prompts(data_dir) -> None:
    """kill -9 after a checkpoint: the queue snapshot (task ids = train indices) restored into a
    fresh process's queue and task set continues the order; what repeats is exactly the tasks
    handed out after the snapshot (leased ones come back first)."""
    args = (f"task.train_files=['{data_dir}/verl.parquet']", "task.shuffle_buffer=32")
    ts = taskset(*args)
    ref = TaskQueue(ts.num_train)
    uninterrupted = []
    for _ in range(8):
        lease = ref.lease("w", 4, 60)
        uninterrupted += [ts.train(t.index).key for t in lease.tasks]

    before = TaskQueue(ts.num_train)
    seen = []
    for _ in range(3):
        lease = before.lease("w", 4, 60)
        seen += [ts.train(t.index).key for t in lease.tasks]
        # done (an ack needs a rollout group; drop marks the tasks done the same way)
        before.drop(lease.lease_id, [t.task_id for t in lease.tasks])
    before.lease("w", 4, 60)  # in flight at the snapshot: comes back first
    snap = json.loads(json.dumps(before.snapshot()))
    lost = before.lease("w", 4, 60)  # handed out after the snapshot, then the process dies
    assert lost is not None

    fresh_ts = taskset(*args)
    after = TaskQueue(fresh_ts.num_train)
    after.restore(snap)
    for _ in range(5):
        lease = after.lease("w", 4, 60)
        seen += [fresh_ts.train(t.index).key for t in lease.tasks]
    assert seen == uninterrupted


def test_hash_split_is_disjoint_and_heldout_files_are_used(data_dir) -> None:
    ts = taskset(f"task.train_files=['{data_dir}/trl.jsonl']", "task.heldout_fraction=0.2")
    n = ts.sources[0].count_train
    train = {ts.train(i).key for i in range(n)}
    held = ts.heldout()
    assert len(held) == 20 and not train & {t.key for t in held}
    st = ts.stats()[0]
    assert st.heldout + st.train == 300 and 30 < st.heldout < 90
    explicit = taskset(
        f"task.train_files=['{data_dir}/trl.jsonl']",
        f"task.heldout_files=['{data_dir}/openrlhf.parquet']",
    )
    assert explicit.sources[0].count_train == 300  # no hash split when held-out files are given
    assert all("label" in t.meta["columns"] for t in explicit.heldout())


def test_sources_mix_by_weight(data_dir) -> None:
    ts = taskset(
        f"task.train_files=[{{path='{data_dir}/trl.jsonl', weight=3.0}}, '{data_dir}/openrlhf.jsonl']"
    )
    layouts = ["label" in ts.train(i).meta["columns"] for i in range(2048)]
    assert sum(layouts) == 512  # exactly 1/4 of each 1024-position period


def test_glob_sources_and_csv_with_quoted_newlines(tmp_path) -> None:
    for k in range(2):
        (tmp_path / f"part-{k}.csv").write_text(
            'prompt,answer,note\n"1+1=",2,"a\nmultiline, quoted note"\n\n"2+2=",4,plain\n'
        )
    ts = taskset(
        f"task.train_files=['{tmp_path}/part-*.csv']",
        "task.heldout_files=['" + f"{tmp_path}/part-0.csv']",
    )
    assert ts.stats()[0].files == 2 and ts.stats()[0].rows == 4
    notes = sorted(ts.train(i).meta["columns"]["note"] for i in range(4))
    assert notes == ["a\nmultiline, quoted note"] * 2 + ["plain"] * 2
    assert {ts.train(i).meta["answer"] for i in range(4)} == {"2", "4"}  # CSV values are strings


def test_parquet_types_reach_meta_as_json(tmp_path) -> None:
    import datetime
    import decimal

    table = pa.table({
        "prompt": ["1+1="], "answer": [2], "when": [datetime.date(2026, 1, 2)],
        "price": pa.array([decimal.Decimal("1.50")]), "blob": [b"\x00\x01"],
        "tags": [["a", "b"]],
    })  # fmt: skip
    pq.write_table(table, tmp_path / "t.parquet")
    ts = taskset(
        f"task.train_files=['{tmp_path}/t.parquet']",
        "task.heldout_files=['" + f"{tmp_path}/t.parquet']",
    )
    cols = ts.train(0).meta["columns"]
    assert json.loads(json.dumps(cols)) == cols
    assert cols["answer"] == 2 and cols["when"] == "2026-01-02" and cols["tags"] == ["a", "b"]
    assert ts.demonstration(ts.train(0)) == "2"


def test_completion_column_is_the_sft_target(tmp_path) -> None:
    rows = [
        {"prompt": [{"role": "user", "content": "1+1="}],
         "completion": [{"role": "assistant", "content": "2"}], "answer": "two"},
        {"prompt": "3+3=", "completion": "6", "answer": "six"},
    ]  # fmt: skip
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = f"{tmp_path}/d.jsonl"
    ts = taskset(f"task.train_files=['{path}']", f"task.heldout_files=['{path}']")
    demos = {ts.train(i).prompt: ts.demonstration(ts.train(i)) for i in range(2)}
    assert demos == {"<bos>1+1=": "2", "3+3=": "6"}
    by_answer = taskset(f"task.train_files=['{path}']", f"task.heldout_files=['{path}']",
                        "task.completion_key=answer")  # fmt: skip
    assert {by_answer.demonstration(by_answer.train(i)) for i in range(2)} == {"two", "six"}


def test_system_prompt_and_explicit_keys(tmp_path) -> None:
    rows = [{"q": "5+5=", "gold": {"v": "10"}, "id": 1}]
    (tmp_path / "d.jsonl").write_text(json.dumps(rows[0]) + "\n")
    path = f"{tmp_path}/d.jsonl"
    ts = taskset(f"task.train_files=['{path}']", f"task.heldout_files=['{path}']",
                 "task.prompt_key=q", "task.answer_key=gold.v", "task.system_prompt='Add. '")  # fmt: skip
    task = ts.train(0)
    assert task.meta["prompt"] == [
        {"role": "system", "content": "Add. "},
        {"role": "user", "content": "5+5="},
    ]
    assert task.meta["answer"] == "10" and task.meta["columns"] == {"gold": {"v": "10"}, "id": 1}
    tok = CharTokenizer()
    assert ts.prompt_ids(task) == [tok.bos_id, *tok.encode("Add. 5+5=")]


def test_chat_prompts_render_as_transformers_apply_chat_template(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    t.train_from_iterator(["What is 12+34? 46", "You are a helpful assistant."] * 20, trainer)
    t.save(str(tok_dir / "tokenizer.json"))
    template = (  # Qwen's ChatML layout
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "chat_template": template,
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False}))  # fmt: skip
    rows = [{"prompt": [{"role": "user", "content": f"What is {a}+34?"}], "answer": str(a + 34)}
            for a in range(10, 20)]  # fmt: skip
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = f"{tmp_path}/d.jsonl"
    ts = taskset(f"task.train_files=['{path}']", f"task.heldout_files=['{path}']",
                 f"task.tokenizer='{tok_dir}'", "task.system_prompt='You are a helpful assistant.'")  # fmt: skip
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    for i in range(10):
        task = ts.train(i)
        want = hf.apply_chat_template(
            task.meta["prompt"], add_generation_prompt=True, tokenize=True
        )
        if not isinstance(want, list):  # transformers 5 returns a BatchEncoding
            want = want["input_ids"]
        assert ts.prompt_ids(task) == list(want)
        assert task.meta["prompt"][0] == {
            "role": "system",
            "content": "You are a helpful assistant.",
        }
        assert task.prompt.endswith("<|im_start|>assistant\n")


def test_the_guide_shows_the_tested_example_config() -> None:
    """docs/data.md's config block is copied from examples/own_data.toml (which the integration
    test runs): every line of it must still be there."""
    doc = (EXAMPLES.parent / "docs" / "data.md").read_text()
    block = doc.split("```toml\n", 1)[1].split("```", 1)[0]
    example = (EXAMPLES / "own_data.toml").read_text()
    assert block.strip() and block in example


def test_json_arrays_and_json_lines(tmp_path) -> None:
    rows = [{"question": f"{a}+1=", "answer": str(a + 1)} for a in range(10)]
    (tmp_path / "array.json").write_text(json.dumps(rows, indent=1))
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("array.json", "lines.json"):
        path = f"{tmp_path}/{name}"
        ts = taskset(f"task.train_files=['file://{path}']", f"task.heldout_files=['{path}']",
                     "task.block_rows=3")  # fmt: skip
        assert ts.stats()[0].rows == 10
        got = sorted((t.meta["prompt"], t.meta["answer"]) for t in (ts.train(i) for i in range(10)))
        assert got == sorted((r["question"], r["answer"]) for r in rows)
