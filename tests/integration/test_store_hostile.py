"""The store as untrusted input: whoever can write it (a shared bucket, a shared disk) must not
run code in the trainer, stall or crash the job, or make it resume from garbage; two jobs never
write one store; a full or read-only disk is a one-line error. Each case ends by checking that
normal operation still works.

Covered: trainer state round trip without pickle (bit-identical resume); pickles refused and
never executed; every kind of bad latest checkpoint (truncated, hash mismatch, manifest not
JSON or malformed, unsafe names, missing file, FIFO, step mismatch, consistent forgeries of the
state) skipped for the newest valid one, with a warning and `ckpt list` showing why; I/O errors
not taken for corruption; weight versions likewise, NaN/inf never published, retention races
still FileNotFoundError, planted symlinks and FIFOs neither followed nor waited on; the store
lock on local disk and S3 (moto; conditional writes and the read-back fallback): refusal naming
the owner, stale and dead-owner takeover, a taken-over holder fenced, races with one winner;
two `slipstream run` jobs on one output_dir or one store; ENOSPC and EROFS through the CLI.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import multiprocessing as mp
import os
import pickle
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from slipstream.cli import main
from slipstream.config.model import ModelConfig
from slipstream.config.rl import TrainerConfig
from slipstream.model import MoEForCausalLM
from slipstream.rl.trainer import Trainer
from slipstream.rl.types import Batch, Group, Sample, TaskRef
from slipstream.storage import (
    BlobStore,
    CheckpointStore,
    InvalidEntry,
    LockLost,
    NonFiniteTensor,
    NoValidCheckpoint,
    StoreLock,
    StoreLocked,
    WeightStore,
)
from slipstream.storage.blob import MANIFEST, _sha256
from slipstream.storage.state import decode_state, encode_state

# ---- helpers --------------------------------------------------------------------------------


def tiny_model(seed: int = 0) -> MoEForCausalLM:
    torch.manual_seed(seed)
    return MoEForCausalLM(ModelConfig(
        vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, intermediate_size=32, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
    ))  # fmt: skip


def batch() -> Batch:
    groups = []
    for n in range(2):
        samples = [Sample([1, 2 + n], [5, 6], [-2.0, -2.0], [0, 0], reward=1.0),
                   Sample([1, 2 + n], [7], [-2.0], [0], reward=0.0),
                   Sample([1, 2 + n], [7, 8, 9], [-2.0, -2.5, -3.0], [0, 0, 0], reward=0.0),
                   Sample([1, 2 + n], [5, 9], [-2.0, -1.0], [0, 0], reward=1.0)]  # fmt: skip
        groups.append(Group(task=TaskRef(n, n), samples=samples))
    return Batch(groups=groups, trainer_version=0)


def trainer(seed: int = 0, **cfg) -> Trainer:
    return Trainer(tiny_model(seed), TrainerConfig(lr=1e-2, **cfg), pad_id=0)


def assert_same_tree(a, b, path="") -> None:
    """Equal values *and* types, tensors bit for bit (dtype, shape, bytes)."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same_tree(a[k], b[k], f"{path}/{k}")
        if isinstance(a, OrderedDict):
            assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), path
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        raw_a, raw_b = (t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
        assert torch.equal(raw_a, raw_b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, path


class Evil:
    """A pickle that creates a file when unpickled: what a store writer could put there."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def rewrite_manifest(step_dir: Path) -> None:
    """What a hostile writer does: make the manifest agree with whatever the files now are."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    manifest["files"] = {
        p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p.read_bytes())}
        for p in sorted(step_dir.iterdir()) if p.is_file() and p.name != MANIFEST
    }  # fmt: skip
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


def two_checkpoints(root: Path) -> tuple[CheckpointStore, dict, dict]:
    """A store with checkpoints at steps 1 and 2 of a real trainer; -> (store, state1, state2)."""
    ck = CheckpointStore(BlobStore(str(root / "store")), keep=5)
    t = trainer()
    states = {}
    for step in (1, 2):
        t.step(batch())
        states[step] = copy.deepcopy(t.state_dict())  # state_dict() holds live tensors
        ck.save(step, states[step], {"queue": {"step": step}}, {"pass_at_1_before": 0.5})
    return ck, states[1], states[2]


# ---- trainer state without pickle -----------------------------------------------------------


def test_trainer_state_round_trips_and_resumes_bit_identically(tmp_path: Path) -> None:
    """model/optimizer/scheduler/RNG/step (+ critic and reference model): every value and type
    back as it was, and a trainer resumed from it takes exactly the same next step."""
    a = trainer(loss="ppo", kl_coef=0.1)
    a.step(batch())
    ck = CheckpointStore(BlobStore(str(tmp_path / "s")))
    saved = a.state_dict()
    ck.save(1, saved, {"queue": []})
    assert not list((tmp_path / "s" / "ckpt" / "step_00000001").glob("*.pt"))
    state, coord, manifest = ck.load(1)
    assert_same_tree(saved, state)
    assert coord == {"queue": []} and manifest["step"] == 1
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    b = trainer(seed=7, loss="ppo", kl_coef=0.1)
    b.load_state_dict(state)  # sets the RNGs back to the saved ones
    assert torch.equal(torch.get_rng_state(), saved["rng"]["torch"])
    assert random.getstate() == saved["rng"]["python"]
    assert np.random.get_state()[1].tobytes() == saved["rng"]["numpy"][1].tobytes()
    assert b.step_count == a.step_count == 1
    ma, mb = a.step(batch()), b.step(batch())
    assert json.dumps(ma) == json.dumps(mb)  # every metric, NaN included, equal
    for (n, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        assert torch.equal(x, y), n


def test_state_codec_covers_the_shapes_and_refuses_what_it_cannot_store() -> None:
    tree = {"t": torch.arange(6, dtype=torch.bfloat16).view(2, 3)[:, 1:],  # non-contiguous view
            "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4, dtype=torch.int64),
            "tied": (w := torch.ones(2)), "tied2": w, "nan": float("nan"), "inf": -float("inf"),
            "big": 2**70, "tuple": (1, (2, None)), "int_keys": {0: "a", 7: [True]},
            "__dunder": 1, "bytes": b"\x00\xff", "np": np.arange(5, dtype=np.uint32),
            "odict": OrderedDict(b=1, a=2)}  # fmt: skip
    back = decode_state(*encode_state(tree))
    assert_same_tree({**tree, "t": tree["t"].contiguous()}, back)
    with pytest.raises(TypeError, match="at /f"):
        encode_state({"f": lambda: 1})
    with pytest.raises(TypeError, match="numpy dtype object"):
        encode_state({"o": np.array([object()])})


@pytest.mark.parametrize(
    "tree_json",
    [
        b'{"format": "slipstream-trainer-state", "version": 1, "tree": {"__reduce__": 1}}',
        b'{"format": "slipstream-trainer-state", "version": 1, "tree": {"__tensor__": "t9"}}',
        b'{"format": "slipstream-trainer-state", "version": 1, "tree": {"x": NaN}}',
        b'{"format": "slipstream-trainer-state", "version": 2, "tree": {}}',
        b'{"format": "pickle", "version": 1, "tree": {}}',
        b'{"format": "slipstream-trainer-state", "version": 1, "tree": '
        b'{"__ndarray__": {"dtype": "|O", "shape": [1], "b64": ""}}}',
        b'{"format": "slipstream-trainer-state", "version": 1, "tree": '
        b'{"__dict__": [[[1], 2]]}}',
        b"[" * 100_000 + b"]" * 100_000,
        b"\xff\xfe not utf-8",
    ],
    ids=["unknown tag", "missing tensor", "NaN literal", "version", "format", "object dtype",
         "unhashable key", "deep nesting", "not utf-8"],
)  # fmt: skip
def test_state_decoder_refuses_forged_trees(tree_json: bytes) -> None:
    tensors, _ = encode_state({})
    with pytest.raises(InvalidEntry):
        decode_state(tensors, tree_json)


def test_pickles_are_never_unpickled(tmp_path: Path, caplog) -> None:
    """A legacy trainer.pt and a pickle disguised as the safetensors file, each with a manifest
    that agrees with it: refused, skipped for the valid checkpoint, and the payload never ran."""
    marker = tmp_path / "pwned"
    ck, state1, _ = two_checkpoints(tmp_path)
    step2 = tmp_path / "store" / "ckpt" / "step_00000002"
    (step2 / "trainer.safetensors").write_bytes(pickle.dumps(Evil(marker)))
    rewrite_manifest(step2)
    with pytest.raises(InvalidEntry, match="safetensors"):
        ck.load(2)
    for name in ("trainer.safetensors", "trainer.json"):
        (step2 / name).unlink()
    torch.save({"model": Evil(marker)}, step2 / "trainer.pt")
    rewrite_manifest(step2)
    with pytest.raises(InvalidEntry, match="pickle"):
        ck.load(2)
    with caplog.at_level(logging.WARNING):
        point = ck.latest_valid()
    assert point.step == 1 and point.skipped[0].step == 2 and "pickle" in point.skipped[0].reason
    assert "checkpoint step 2 is invalid" in caplog.text
    assert not marker.exists()
    assert_same_tree(ck.load(1)[0], state1)


# ---- a bad latest checkpoint ----------------------------------------------------------------


def _truncate(d: Path) -> None:
    p = d / "trainer.safetensors"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip(d: Path) -> None:
    p = d / "trainer.json"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _forged_state(d: Path) -> None:
    (d / "trainer.json").write_text('{"format": "slipstream-trainer-state", "version": 1, '
                                    '"tree": {"__import__": "os"}}')  # fmt: skip
    rewrite_manifest(d)


def _wrong_step(d: Path) -> None:
    src = d.parent / "step_00000001"
    for p in src.iterdir():
        shutil.copy(p, d / p.name)


def _unsafe_name(d: Path) -> None:
    manifest = json.loads((d / MANIFEST).read_text())
    manifest["files"]["../../outside.txt"] = {"bytes": 1, "sha256": "0" * 64}
    (d / MANIFEST).write_text(json.dumps(manifest))


def _manifest_fifo(d: Path) -> None:
    (d / MANIFEST).unlink()
    os.mkfifo(d / MANIFEST)


def _file_fifo(d: Path) -> None:
    (d / "coordinator.json").unlink()
    os.mkfifo(d / "coordinator.json")


def _symlinked_file(d: Path) -> None:
    (d / "coordinator.json").unlink()
    (d / "coordinator.json").symlink_to("/dev/zero")


BAD_LATEST = {
    "truncated file": (_truncate, "truncated"),
    "hash mismatch": (_flip, "does not match its manifest"),
    "manifest not JSON": (lambda d: (d / MANIFEST).write_bytes(b'{"files": {'), "not JSON"),
    "manifest not an object": (lambda d: (d / MANIFEST).write_text("[1, 2]"), "not an object"),
    "manifest entry malformed": (lambda d: (d / MANIFEST).write_text(
        '{"step": 2, "files": {"trainer.json": {"bytes": "9", "sha256": "x"}}}'), "malformed"),
    "manifest unsafe name": (_unsafe_name, "unsafe file name"),
    "missing file": (lambda d: (d / "coordinator.json").unlink(), "missing"),
    "manifest is a FIFO": (_manifest_fifo, "not a regular file"),
    "file is a FIFO": (_file_fifo, "bytes, the manifest says"),
    "file is a symlink to a device": (_symlinked_file, "bytes, the manifest says"),
    "step mismatch": (_wrong_step, "says step 1"),
    "forged state, consistent manifest": (_forged_state, "unknown tagged object"),
    "manifest lists no state": (lambda d: (d / MANIFEST).write_text(
        json.dumps({"step": 2, "files": {}})), "does not list"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_LATEST))
def test_bad_latest_checkpoint_falls_back_to_the_newest_valid(tmp_path: Path, case: str,
                                                              caplog, capsys) -> None:  # fmt: skip
    corrupt, reason = BAD_LATEST[case]
    ck, state1, state2 = two_checkpoints(tmp_path)
    corrupt(tmp_path / "store" / "ckpt" / "step_00000002")
    with caplog.at_level(logging.WARNING):
        point = ck.latest_valid()
    assert point.step == 1, point
    assert [b.step for b in point.skipped] == [2] and reason in point.skipped[0].reason, point
    assert "checkpoint step 2 is invalid" in caplog.text and "resuming from step 1" in caplog.text
    assert point.warnings() == [f"checkpoint step 2 is invalid ({point.skipped[0].reason}); "
                                "resuming from step 1"]  # fmt: skip
    assert not (tmp_path / "outside.txt").exists()
    # `ckpt list` shows each one's validity (and says why on stderr)
    assert main(["ckpt", "list", f"--store.url={tmp_path / 'store'}"]) == 0
    out = capsys.readouterr()
    listed = json.loads(out.out)
    assert [(c["step"], c["valid"]) for c in listed["checkpoints"]] == [(1, True), (2, False)]
    assert "checkpoint step 2 is invalid" in out.err
    # normal operation afterwards: resume from 1, drop the bad 2, save 2 again, resume from it
    assert_same_tree(ck.load(1)[0], state1)
    assert ck.remove_after(point.step) == [2]
    ck.save(2, state2, {"queue": {"step": 2}})
    assert ck.latest_valid().step == 2 and not ck.latest_valid().skipped
    assert_same_tree(ck.load(2)[0], state2)


def test_no_valid_checkpoint_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    ck, _, state2 = two_checkpoints(tmp_path)
    for step in (1, 2):
        _truncate(tmp_path / "store" / "ckpt" / f"step_{step:08d}")
    with pytest.raises(NoValidCheckpoint, match="step 2: .*truncated.*step 1: .*truncated"):
        ck.latest_valid()
    assert CheckpointStore(BlobStore(str(tmp_path / "empty"))).latest_valid().step is None
    assert ck.remove_after(None) == [1, 2]
    ck.save(3, state2 | {"step": 3}, {})
    assert ck.latest_valid().step == 3


@pytest.mark.parametrize("error", [OSError(errno.EIO, "Input/output error"),
                                   ConnectionResetError(errno.ECONNRESET, "reset"),
                                   PermissionError(errno.EACCES, "Permission denied")])  # fmt: skip
def test_io_errors_are_raised_not_taken_for_corruption(tmp_path: Path, error: OSError,
                                                       monkeypatch) -> None:  # fmt: skip
    """A flaky network or a permission problem must not make the resume skip good checkpoints
    (or the run start over and its retention delete them)."""
    ck, _, _ = two_checkpoints(tmp_path)
    real_get = ck.blob.get

    def flaky(rel: str) -> bytes:
        if rel.endswith("trainer.safetensors"):
            raise error
        return real_get(rel)

    monkeypatch.setattr(ck.blob, "get", flaky)
    with pytest.raises(type(error)):
        ck.latest_valid()
    monkeypatch.undo()
    assert ck.latest_valid().step == 2


def test_save_refuses_non_finite_state_and_keeps_the_last_good_one(tmp_path: Path) -> None:
    ck, _, state2 = two_checkpoints(tmp_path)
    bad = {**state2, "step": 3, "model": dict(state2["model"])}
    name = next(iter(bad["model"]))
    bad["model"][name] = bad["model"][name].clone().fill_(float("nan"))
    with pytest.raises(NonFiniteTensor, match=f"model/{name}"):
        ck.save(3, bad, {})
    assert ck.steps() == [1, 2] and ck.latest_valid().step == 2


def test_bad_checkpoint_on_s3_falls_back(tmp_path: Path, moto: int) -> None:
    from s3util import make_bucket, s3_options

    make_bucket(moto)
    ck = CheckpointStore(BlobStore("s3://bucket/run", s3_options(moto)), keep=3)
    t = trainer()
    for step in (1, 2):
        t.step(batch())
        ck.save(step, t.state_dict(), {"step": step})
    blob = ck.blob
    data = blob.get("ckpt/step_00000002/trainer.safetensors")
    blob.put("ckpt/step_00000002/trainer.safetensors", data[:100])
    point = ck.latest_valid()
    assert point.step == 1 and "truncated" in point.skipped[0].reason
    blob.put("ckpt/step_00000002/manifest.json", b"not json")
    assert "not JSON" in ck.latest_valid().skipped[0].reason
    assert ck.remove_after(1) == [2] and ck.steps() == [1]
    ck.save(2, t.state_dict(), {"step": 2})
    assert ck.latest_valid().step == 2


# ---- weight versions ------------------------------------------------------------------------


def sd(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 16, generator=g), "b.bias": torch.randn(16, generator=g),
            "count": torch.arange(4)}  # fmt: skip


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_never_published(tmp_path: Path, value: float) -> None:
    store = WeightStore(str(tmp_path / "s"))
    store.publish(1, sd(1))
    bad = sd(2)
    bad["b.bias"][3] = value
    with pytest.raises(NonFiniteTensor, match=r"version 2 .*'b\.bias' has 1 of 16"):
        store.publish(2, bad)
    assert store.versions() == [1] and not (tmp_path / "s" / "weights" / "v00000002").exists()
    store.publish(2, sd(2))
    assert torch.equal(store.fetch(2)["a.weight"], sd(2)["a.weight"])


def test_nan_loss_step_is_not_published(tmp_path: Path) -> None:
    """The trainer's case: an infinite learning rate (refused by the config, forced here) makes
    the weights NaN after one step; publishing them is refused, naming a tensor."""
    t = trainer()
    for group in t.optimizer.param_groups:
        group["lr"] = float("inf")
    t.scheduler.base_lrs = [float("inf")] * len(t.scheduler.base_lrs)
    t.step(batch())
    store = WeightStore(str(tmp_path / "s"))
    with pytest.raises(NonFiniteTensor, match="refusing to publish weights version 1"):
        store.publish(t.version, t.full_state())
    assert store.versions() == []


def _weights_dir(tmp: Path, v: int) -> Path:
    return tmp / "s" / "weights" / f"v{v:08d}"


BAD_VERSION = {
    "truncated": (lambda d: (d / "model.safetensors").write_bytes(b"\x08"), "truncated"),
    "manifest not JSON": (lambda d: (d / MANIFEST).write_text("nope"), "not JSON"),
    "random safetensors, consistent manifest": (
        lambda d: ((d / "model.safetensors").write_bytes(os.urandom(300)), rewrite_manifest(d)),
        "not a valid safetensors"),
    "config not JSON, consistent manifest": (
        lambda d: ((d / "config.json").write_text("{"), rewrite_manifest(d)), "not JSON"),
    "manifest is a FIFO": (lambda d: ((d / MANIFEST).unlink(), os.mkfifo(d / MANIFEST)),
                           "not a regular file"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_VERSION))
def test_bad_weight_version_is_invalid_not_loaded(tmp_path: Path, case: str, capsys) -> None:
    corrupt, reason = BAD_VERSION[case]
    store = WeightStore(str(tmp_path / "s"), keep_last=5)
    store.publish(1, sd(1), {"hidden_size": 16})
    store.publish(2, sd(2), {"hidden_size": 16})
    corrupt(_weights_dir(tmp_path, 2))
    with pytest.raises(InvalidEntry, match=reason):
        store.fetch(2) if "config" not in case else store.fetch_config(2)
    assert reason in store.check(2) and store.check(1) is None
    assert main(["ckpt", "list", f"--store.url={tmp_path / 's'}"]) == 0
    listed = json.loads(capsys.readouterr().out)["weights"]
    assert [(w["version"], w["valid"]) for w in listed] == [(1, True), (2, False)]
    if "consistent manifest" not in case:  # a copy checks the manifest, not the formats
        with pytest.raises(InvalidEntry):
            store.fetch_to_dir(2, str(tmp_path / "export"))
    store.publish(2, sd(2), {"hidden_size": 16})  # republishing overwrites the bad one
    assert store.check(2) is None and torch.equal(store.fetch(2)["b.bias"], sd(2)["b.bias"])


def test_forged_nan_weights_are_flagged_invalid(tmp_path: Path) -> None:
    from safetensors.torch import save

    store = WeightStore(str(tmp_path / "s"))
    store.publish(1, sd(1))
    bad = sd(1)
    bad["a.weight"][0, 0] = float("nan")
    (_weights_dir(tmp_path, 1) / "model.safetensors").write_bytes(save(bad))
    rewrite_manifest(_weights_dir(tmp_path, 1))
    assert "'a.weight' has 1 of 1024 values NaN or inf" in store.check(1)


def test_retention_race_stays_file_not_found(tmp_path: Path, monkeypatch) -> None:
    """A reader whose version is deleted by retention half-way gets FileNotFoundError (the
    worker asks for the latest again), not InvalidEntry."""
    store = WeightStore(str(tmp_path / "s"))
    store.publish(1, sd(1))
    real_get = store.blob.get

    def deleted_meanwhile(rel: str) -> bytes:
        if rel.endswith("model.safetensors"):
            store.blob.rm(f"weights/v00000001/{MANIFEST}")
            store.blob.rm("weights/v00000001")
        return real_get(rel)

    monkeypatch.setattr(store.blob, "get", deleted_meanwhile)
    with pytest.raises(FileNotFoundError) as info:
        store.fetch(1)
    assert not isinstance(info.value, InvalidEntry)
    with pytest.raises(FileNotFoundError):
        store.fetch(7)


def test_unsafe_names_never_leave_the_export_dir(tmp_path: Path) -> None:
    store = WeightStore(str(tmp_path / "s"))
    store.publish(1, sd(1))
    d = _weights_dir(tmp_path, 1)
    (d.parent / "evil.txt").write_text("x")
    manifest = json.loads((d / MANIFEST).read_text())
    manifest["files"]["../evil.txt"] = {"bytes": 1, "sha256": _sha256(b"x")}
    (d / MANIFEST).write_text(json.dumps(manifest))
    out = tmp_path / "export" / "inner"
    with pytest.raises(InvalidEntry, match="unsafe file name"):
        store.fetch_to_dir(1, str(out))
    assert not (tmp_path / "export" / "evil.txt").exists() and not out.exists()


def test_planted_symlinks_and_fifos_are_not_followed(tmp_path: Path) -> None:
    store = WeightStore(str(tmp_path / "s"), keep_last=10)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "s" / "weights").mkdir(parents=True)
    _weights_dir(tmp_path, 5).symlink_to(outside)
    with pytest.raises(InvalidEntry, match="a symlink inside the store"):
        store.publish(5, sd(5))
    assert list(outside.iterdir()) == []
    _weights_dir(tmp_path, 6).mkdir()
    os.mkfifo(_weights_dir(tmp_path, 6) / "model.safetensors")  # no reader: a write would block
    (_weights_dir(tmp_path, 6) / "config.json").symlink_to(outside / "target.json")
    store.publish(6, sd(6), {"x": 1})
    assert torch.equal(store.fetch(6)["a.weight"], sd(6)["a.weight"])
    assert list(outside.iterdir()) == []
    store.blob.rm("weights/v00000005")  # removes the link, not what it points to
    assert outside.is_dir() and not _weights_dir(tmp_path, 5).exists()
    store.publish(5, sd(5))
    assert store.versions() == [5, 6]


def test_symlinked_weights_and_ckpt_dirs_are_refused_before_anything_is_deleted(
    tmp_path: Path,
) -> None:
    """Issue 32: a store writer replaces weights/ and ckpt/ with links to another store's; a
    resume (remove_after), a save (which first clears its step dir) and retention must refuse,
    naming the link, and leave the target's v00000099 and step_00000099 in place."""
    other = tmp_path / "other"
    WeightStore(str(other)).publish(99, sd(99))
    CheckpointStore(BlobStore(str(other))).save(99, {"step": 99, "w": sd(99)}, {"queue": []})
    before = sorted(str(p.relative_to(other)) for p in other.rglob("*"))
    store = tmp_path / "s"
    store.mkdir()
    (store / "weights").symlink_to(other / "weights")
    (store / "ckpt").symlink_to(other / "ckpt")
    weights, ckpts = WeightStore(str(store)), CheckpointStore(BlobStore(str(store)))
    with pytest.raises(InvalidEntry, match=f"{store}/weights: a symlink inside the store; "
                                           "refusing to delete through it"):  # fmt: skip
        weights.remove_after(5)
    with pytest.raises(InvalidEntry, match=f"{store}/ckpt: a symlink inside the store"):
        ckpts.remove_after(5)
    with pytest.raises(InvalidEntry, match=f"{store}/ckpt: a symlink inside the store"):
        ckpts.save(99, {"step": 99, "w": sd(1)}, {"queue": []})
    with pytest.raises(InvalidEntry, match=f"{store}/weights: a symlink inside the store"):
        weights.publish(100, sd(100))
    assert sorted(str(p.relative_to(other)) for p in other.rglob("*")) == before
    assert WeightStore(str(other)).versions() == [99]
    assert CheckpointStore(BlobStore(str(other))).latest_valid().step == 99


# ---- one writer per store -------------------------------------------------------------------


def _lock_urls(tmp: Path, moto: int | None) -> tuple[str, dict]:
    if moto is None:
        return str(tmp / "store"), {}
    from s3util import make_bucket, s3_options

    make_bucket(moto)
    return "s3://bucket/locked", s3_options(moto)


@pytest.fixture(params=["local", "s3", "s3-readback"])
def lock_store(request, tmp_path: Path):
    """(url, storage options, StoreLock kwargs) on local disk, on S3 with conditional writes,
    and on S3 through the write-then-read-back fallback."""
    if request.param == "local":
        yield (*_lock_urls(tmp_path, None), {})
        return
    port = request.getfixturevalue("moto")
    kwargs = {"conditional": False, "settle_s": 0.05} if request.param == "s3-readback" else {}
    yield (*_lock_urls(tmp_path, port), kwargs)


def test_second_job_is_refused_naming_the_owner(lock_store) -> None:
    url, opts, kw = lock_store
    a = StoreLock(BlobStore(url, opts), owner="job A", extra={"output_dir": "/runs/a"}, **kw)
    a.acquire()
    b = StoreLock(BlobStore(url, opts), owner="job B", **kw)
    with pytest.raises(StoreLocked) as info:
        b.acquire()
    msg = str(info.value)
    assert "'job A'" in msg and f"pid {os.getpid()}" in msg and socket.gethostname() in msg
    assert "/runs/a" in msg and "last heartbeat" in msg
    a.beat()
    a.release()
    b.acquire()  # normal operation once the first is gone
    b.beat()
    b.release()
    assert not BlobStore(url, opts).exists("lock.json")


def _write_lock(url: str, opts: dict, **fields) -> None:
    rec = {"owner": "old job", "host": "elsewhere", "pid": 4242, "boot_id": "x",
           "pid_namespace": "pid:[1]", "token": "t" * 32, "ttl_s": 60.0, "beats": 3,
           "acquired_unix_s": time.time() - 500, "heartbeat_unix_s": time.time(), **fields}  # fmt: skip
    BlobStore(url, opts).put("lock.json", json.dumps(rec).encode())


def test_stale_lock_is_taken_over_loudly(lock_store, caplog) -> None:
    url, opts, kw = lock_store
    _write_lock(url, opts)  # another host, fresh heartbeat: live
    with pytest.raises(StoreLocked, match="'old job' pid 4242 on host elsewhere"):
        StoreLock(BlobStore(url, opts), owner="new", **kw).acquire()
    _write_lock(url, opts, heartbeat_unix_s=time.time() - 120)  # TTL 60 s: stale
    lock = StoreLock(BlobStore(url, opts), owner="new", **kw)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    assert "took over the stale lock of 'old job' pid 4242 on host elsewhere" in caplog.text
    assert lock.took_over["owner"] == "old job"
    assert re.fullmatch(r"its last heartbeat is \d+ s old \(TTL 60 s\)", lock.took_over["reason"])
    lock.beat()
    lock.release()


def test_unreadable_lock_is_not_taken_over(lock_store) -> None:
    url, opts, kw = lock_store
    BlobStore(url, opts).put("lock.json", b"\x00garbage")
    with pytest.raises(StoreLocked, match="not a valid lock record; if no job is using it"):
        StoreLock(BlobStore(url, opts), **kw).acquire()
    BlobStore(url, opts).rm("lock.json")
    with StoreLock(BlobStore(url, opts), **kw):
        pass


def test_taken_over_holder_is_fenced_and_stopped(lock_store) -> None:
    """A holder frozen past its TTL finds, at its next heartbeat, that another job took the
    lock: it stops (on_lost), and every later write to the store raises LockLost."""
    url, opts, kw = lock_store
    lost = threading.Event()
    blob = BlobStore(url, opts)
    a = StoreLock(blob, owner="frozen job", heartbeat_s=0.05, on_lost=lambda e: lost.set(), **kw)
    a.acquire()
    blob.put("weights/ok.bin", b"1")  # writes pass while the lock is held
    _write_lock(url, opts, owner="the new job")  # what a takeover leaves
    a.start_heartbeat()
    assert lost.wait(60), "the heartbeat never noticed"
    with pytest.raises(LockLost, match="lost the store lock; it is now held by 'the new job'"):
        blob.put("weights/late.bin", b"2")
    with pytest.raises(LockLost):
        a.beat()
    a.release()  # does not delete the new owner's lock
    assert json.loads(BlobStore(url, opts).get("lock.json"))["owner"] == "the new job"
    BlobStore(url, opts).rm("lock.json")
    with StoreLock(BlobStore(url, opts), **kw):  # normal operation afterwards
        blob.put("weights/after.bin", b"3")


def test_lock_of_a_killed_job_on_this_machine_is_taken_at_once(tmp_path: Path, caplog) -> None:
    url = str(tmp_path / "store")
    code = ("import sys, time; from slipstream.storage import BlobStore, StoreLock; "
            f"StoreLock(BlobStore({url!r}), owner='killed job').acquire(); "
            "print('held', flush=True); time.sleep(600)")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(StoreLocked, match="'killed job'"):
            StoreLock(BlobStore(url)).acquire()
    finally:
        proc.kill()
        proc.wait()
    lock = StoreLock(BlobStore(url), owner="restarted job")
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    assert f"its process {proc.pid} on this machine is gone" in lock.took_over["reason"]
    assert "took over the stale lock" in caplog.text
    lock.release()


def _race(url: str, barrier, done, results) -> None:
    lock = StoreLock(BlobStore(url), owner=f"racer {os.getpid()}")
    barrier.wait()
    try:
        lock.acquire()
    except StoreLocked:
        results.put("refused")
        return
    results.put("won")
    done.wait(120)  # hold it until every racer has tried
    lock.release()


def test_racing_jobs_have_one_winner(tmp_path: Path) -> None:
    n = 6
    ctx = mp.get_context("fork")
    barrier, done, results = ctx.Barrier(n), ctx.Event(), ctx.Queue()
    url = str(tmp_path / "store")
    BlobStore(url)
    procs = [ctx.Process(target=_race, args=(url, barrier, done, results)) for _ in range(n)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in range(n))
    done.set()
    for p in procs:
        p.join(timeout=60)
    assert got == ["refused"] * (n - 1) + ["won"], got
    assert [p.exitcode for p in procs] == [0] * n
    with StoreLock(BlobStore(url)):  # released by the winner
        pass


# ---- two jobs on one output_dir / store (real processes) ------------------------------------

TINY_JOB = ["trainer.mode=sync", "trainer.steps=100000", "trainer.groups_per_step=2",
            "rollout.group_size=4", "rollout.num_workers=1", "trainer.checkpoint_every=0",
            "trainer.eval_every=0", "trainer.skip_no_signal=false"]  # fmt: skip


@pytest.mark.slow
def test_second_job_on_the_same_output_dir_or_store_is_refused(tmp_path: Path) -> None:
    """The first job runs until it is stopped (SIGTERM), so the others start while it runs
    whatever the machine's speed; they are refused, and it never sees them."""
    from jobutil import TINY_MODEL, job_cmd, save_random_init, trained_steps

    save_random_init(tmp_path / "init", [*TINY_MODEL, *TINY_JOB])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = tmp_path / "a"
    first = subprocess.Popen(job_cmd(tmp_path, out, [*TINY_MODEL, *TINY_JOB]), env=env,
                             stdout=subprocess.DEVNULL, stderr=open(tmp_path / "a.err", "wb"),
                             start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not trained_steps(out / "metrics.jsonl"):
            assert first.poll() is None, (tmp_path / "a.err").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        same_dir = subprocess.run(job_cmd(tmp_path, out, [*TINY_MODEL, *TINY_JOB]), env=env,
                                  capture_output=True, text=True, timeout=120)  # fmt: skip
        same_store = subprocess.run(
            job_cmd(tmp_path, tmp_path / "b", [*TINY_MODEL, *TINY_JOB, f"store.url={out}/store"]),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert first.poll() is None, (tmp_path / "a.err").read_text()[-3000:]
        first.send_signal(signal.SIGTERM)  # the drain: exit 143, locks released
        assert first.wait(timeout=120) == 143, (tmp_path / "a.err").read_text()[-3000:]
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for refused, what in ((same_dir, f"output directory {out}"), (same_store, f"store {out}")):
        assert refused.returncode == 1, refused.stderr[-2000:]
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
        assert f"the {what}" in lines[0] and "in use by another job" in lines[0]
        assert f"'slipstream run' pid {first.pid}" in lines[0]
    assert not (tmp_path / "b" / "metrics.jsonl").exists()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, len(steps) + 1))  # one writer: every line whole, none twice
    assert not (out / ".slipstream-lock.json").exists()
    assert not (out / "store" / "lock.json").exists()


# ---- a full or read-only disk: one-line errors, nothing half-visible ------------------------


def _in_mount_namespace(tmp: Path, mount_opts: str, script: str) -> subprocess.CompletedProcess:
    """Run `script` (bash) in a private mount namespace with a tmpfs at tmp/mnt."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to mount a small tmpfs")
    mnt = tmp / "mnt"
    mnt.mkdir(exist_ok=True)
    cmd = f"mount -t tmpfs -o {mount_opts} tmpfs {mnt} && {script}"
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c", cmd],
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    if "mount:" in done.stderr and "permission denied" in done.stderr.lower():
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    return done


ENOSPC_SCRIPT = r"""
import errno, json, os, sys, torch
from slipstream.storage import BlobStore, CheckpointStore, WeightStore
root = sys.argv[1]
store = WeightStore(root + "/store")
ckpts = CheckpointStore(store.blob)
big = {"w": torch.randn(128, 1024)}                        # 512 KiB: more than the disk holds
out = {}
for name, write in (("publish", lambda: store.publish(1, big)),
                    ("checkpoint", lambda: ckpts.save(1, {"model": big, "step": 1}, {}))):
    try:
        write()
        out[name] = "wrote"
    except OSError as e:
        out[name] = [e.errno, str(e.filename)]
out["visible"] = [store.versions(), ckpts.steps()]
small = {"w": torch.randn(8, 8)}                            # fits: space was never the store's
store.publish(1, small); ckpts.save(1, {"model": small, "step": 1}, {})
out["after"] = [store.versions(), ckpts.latest_valid().step,
                bool(torch.equal(store.fetch(1)["w"], small["w"]))]
print(json.dumps(out))
"""


def test_enospc_during_publish_and_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "enospc.py").write_text(ENOSPC_SCRIPT)
    done = _in_mount_namespace(tmp_path, "size=256k",
                               f"{sys.executable} {tmp_path / 'enospc.py'} {tmp_path / 'mnt'}")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("publish", "checkpoint"):
        assert out[name][0] == errno.ENOSPC, out
        assert out[name][1].startswith(str(tmp_path / "mnt" / "store")), out
    assert out["visible"] == [[], []]  # nothing half-written is visible
    assert out["after"] == [[1], 1, True]


def test_cli_os_errors_are_one_line_naming_the_path(tmp_path: Path) -> None:
    """ENOSPC and EROFS through the entry point: `slipstream: PATH: reason`, exit 1."""
    store = WeightStore(str(tmp_path / "store"))
    store.publish(3, {"w": torch.randn(256, 1024)})  # 1 MiB
    slipstream = Path(sys.executable).parent / "slipstream"
    mnt = tmp_path / "mnt"
    script = (f"{slipstream} ckpt export --store.url={tmp_path / 'store'} {mnt}/out; echo rc=$?; "
              f"mount -o remount,ro {mnt}; "
              f"{slipstream} sft --run.output_dir={mnt}/run; echo rc=$?")  # fmt: skip
    done = _in_mount_namespace(tmp_path, "size=128k", script)
    assert done.stdout.count("rc=1") == 2, (done.stdout, done.stderr[-3000:])
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and len(lines) == 2, done.stderr[-3000:]
    assert lines[0].startswith(f"slipstream: {mnt}/out/") and "No space left" in lines[0]
    assert lines[1].startswith(f"slipstream: {mnt}/run") and "Read-only file system" in lines[1]
