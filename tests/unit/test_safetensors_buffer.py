"""SafetensorsBuffer (one reusable buffer holding a whole safetensors file), the publish path
that writes it (WeightStore.publish, rl/publisher.py) and check_finite's fused fast path."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from slipstream.rl.publisher import Publisher
from slipstream.storage import WeightStore, check_finite
from slipstream.storage.errors import NonFiniteTensor
from slipstream.storage.safetensors_buffer import SafetensorsBuffer


def mixed_state(seed: int) -> dict[str, torch.Tensor]:
    """Mixed dtypes, a 0-dim and an empty tensor, and views sharing storage (a tied weight,
    per-expert slices of a stacked tensor, as hf_from_internal makes them)."""
    g = torch.Generator().manual_seed(seed)
    stacked = torch.randn(3, 4, 5, generator=g)
    emb = torch.randn(7, 5, generator=g)
    return {
        "embed.weight": emb,
        "lm_head.weight": emb,
        **{f"experts.{e}.gate.weight": stacked[e, :2] for e in range(3)},
        **{f"experts.{e}.up.weight": stacked[e, 2:] for e in range(3)},
        "norm.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "step": torch.tensor(seed, dtype=torch.int64),
        "mask": torch.rand(6, generator=g) > 0.5,
        "empty": torch.empty(0, 5),
        "half": torch.randn(3, generator=g).to(torch.float16),
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def test_the_buffer_is_a_safetensors_file_the_library_reads_back() -> None:
    state = mixed_state(0)
    buf = SafetensorsBuffer.for_tensors(state)
    buf.fill(state)
    raw = bytes(buf.file_bytes())
    assert len(raw) == buf.nbytes
    assert_same(st_load(raw), state)
    # same header content as the library's own writer (order and padding may differ)
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0
    ours = json.loads(raw[8 : 8 + n])
    lib = st_save({k: v.clone() for k, v in state.items()})
    (m,) = struct.unpack("<Q", lib[:8])
    theirs = {k: v for k, v in json.loads(lib[8 : 8 + m]).items() if k != "__metadata__"}
    assert {k: (v["dtype"], v["shape"]) for k, v in ours.items()} == {
        k: (v["dtype"], v["shape"]) for k, v in theirs.items()
    }
    # no holes: the regions tile the data exactly
    spans = sorted(tuple(v["data_offsets"]) for v in ours.values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] == len(raw) - 8 - n


def test_refill_replaces_the_values_and_a_different_layout_is_refused() -> None:
    buf = SafetensorsBuffer.for_tensors(mixed_state(0))
    buf.fill(mixed_state(1))
    assert_same(st_load(bytes(buf.file_bytes())), mixed_state(1))
    assert_same(buf.tensors(), mixed_state(1))
    other = mixed_state(2)
    other["norm.weight"] = other["norm.weight"].float()
    assert not buf.matches(other)
    with pytest.raises(ValueError, match="'norm.weight' is torch.float32"):
        buf.fill(other)
    missing = mixed_state(2)
    del missing["step"]
    with pytest.raises(ValueError, match="missing \\['step'\\]"):
        buf.fill(missing)
    with pytest.raises(ValueError, match="complex64"):
        SafetensorsBuffer.for_tensors({"z": torch.zeros(2, dtype=torch.complex64)})


def test_store_publishes_a_buffer_and_refuses_a_non_finite_one(tmp_path: Path) -> None:
    store = WeightStore(f"file://{tmp_path}/store", keep_last=2)
    buf = SafetensorsBuffer.for_tensors(mixed_state(0))
    for v in range(3):
        buf.fill(mixed_state(v))
        store.publish(v, buf, config={"hidden_size": 5})
    assert store.versions() == [1, 2]
    assert store.check(2) is None
    assert_same(store.fetch(2), mixed_state(2))
    bad = mixed_state(3)
    bad["experts.1.up.weight"] = bad["experts.1.up.weight"].clone()
    bad["experts.1.up.weight"][0, 0] = float("nan")
    buf.fill(bad)
    with pytest.raises(NonFiniteTensor, match="'experts.1.up.weight' has 1 of 10 values"):
        store.publish(3, buf)
    assert store.versions() == [1, 2]


def test_check_finite_fast_path_keeps_the_exact_answer() -> None:
    big = {"w": torch.full((4,), 3e30), "b": torch.ones(2, dtype=torch.bfloat16)}
    check_finite(big, "x")  # finite, though the fused 2-norm overflows: the exact scan decides
    for bad_value in (float("inf"), float("-inf"), float("nan")):
        t = {"w": torch.ones(8), "v": torch.ones(3, dtype=torch.bfloat16), "i": torch.arange(3)}
        t["v"][1] = bad_value
        with pytest.raises(NonFiniteTensor, match="tensor 'v' has 1 of 3 values"):
            check_finite(t, "x")


@pytest.mark.parametrize("background", [True, False])
def test_publisher_copies_the_state_before_submit_returns(tmp_path: Path, background: bool) -> None:
    class Coord:
        def __init__(self) -> None:
            self.versions: list[int] = []

        def set_version(self, v: int) -> None:
            self.versions.append(v)

    store, coord = WeightStore(str(tmp_path / "store"), keep_last=5), Coord()
    pub = Publisher(store, coord, background=background)
    live = mixed_state(0)
    for v in range(3):
        want = {k: t.clone() for k, t in live.items()}
        pub.submit(v, live, {"v": v})
        with torch.no_grad():  # the trainer's next step writes into the live tensors at once
            for t in live.values():
                if t.is_floating_point():
                    t.add_(1.0)
        pub.flush()
        assert_same(store.fetch(v), want)
    assert coord.versions == [0, 1, 2]
