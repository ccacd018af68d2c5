"""One reusable buffer that holds a whole safetensors file for a fixed set of tensors, so a
trainer that publishes every step serialises a version with one copy per tensor and no
per-tensor Python on the writing thread.

    buf = SafetensorsBuffer.for_tensors(state)   # layout and header made once
    buf.fill(state)                              # copies the values in (the caller's thread)
    data = buf.file_bytes()                      # the file: a view of the buffer, no copy

Why: `safetensors.torch.save` spends ~50 us of Python per tensor (checks, numpy views, a
shared-storage scan) and returns a new bytes object; the quickstart's 135 HF-named tensors
cost 7-10 ms of it per publish, and the publish thread's Python contends for the GIL with the
trainer's step (measured: a background publish per step slowed the quickstart's trainer step
by 10-35 ms in one harness, docs/performance.md). Here the header (names, dtypes, shapes,
offsets) is JSON written once into the buffer; `fill` is one `torch._foreach_copy_`; the file
is the buffer.

Contract:
- The file is a valid safetensors file (8-byte little-endian header length, JSON header padded
  with spaces to 8 bytes, then the data with no holes); `safetensors.torch.load` reads back
  exactly the tensors filled in. Tensors are laid out by decreasing element size, so each
  region is aligned to its dtype.
- `fill` takes the same names, dtypes and shapes the layout was made for (ValueError naming the
  first difference otherwise; `matches` tells beforehand). Sources may be views sharing storage
  (tied weights, per-expert slices of a stacked tensor): each name gets its own region.
- `file_bytes()` and `tensors()` are views of the one buffer: a later `fill` changes them. The
  owner must not fill while a reader of the last file is still running (rl/publisher.py fills
  only after the previous publish finished).

Not covered: non-strided (sparse) tensors, dtypes safetensors has no code for, `__metadata__`.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping

import torch

_DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip

Spec = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def spec_of(tensors: Mapping[str, torch.Tensor]) -> Spec:
    """name -> (dtype, shape): what a layout is made for."""
    return {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}


class SafetensorsBuffer:
    """The buffer for one layout (`spec`: name -> (dtype, shape)); see the module contract."""

    def __init__(self, spec: Spec) -> None:
        for name, (dtype, _) in spec.items():
            if dtype not in _DTYPE_CODES:
                raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors code")
        self.spec = dict(spec)
        # largest element first: every region starts at a multiple of its element size
        order = sorted(spec, key=lambda n: (-spec[n][0].itemsize, n))
        header: dict[str, dict] = {}
        regions: list[tuple[str, int, int]] = []
        at = 0
        for name in order:
            dtype, shape = spec[name]
            nbytes = dtype.itemsize * math.prod(shape)
            header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape),
                            "data_offsets": [at, at + nbytes]}  # fmt: skip
            regions.append((name, at, nbytes))
            at += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned
        start = 8 + len(raw)
        self._buf_U8 = torch.empty(start + at, dtype=torch.uint8, device="cpu")
        self._buf_U8[:8] = torch.frombuffer(
            bytearray(struct.pack("<Q", len(raw))), dtype=torch.uint8
        )
        self._buf_U8[8:start] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self._views: dict[str, torch.Tensor] = {}
        for name, offset, nbytes in regions:
            dtype, shape = spec[name]
            region = self._buf_U8[start + offset : start + offset + nbytes]
            self._views[name] = region.view(dtype).view(shape)
        self._targets = [self._views[n] for n in spec]  # in `spec` order, as `fill` reads

    @classmethod
    def for_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> SafetensorsBuffer:
        return cls(spec_of(tensors))

    def matches(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Same names (in any order), dtypes and shapes as this layout."""
        return len(tensors) == len(self.spec) and all(
            self.spec.get(n) == (t.dtype, tuple(t.shape)) for n, t in tensors.items()
        )

    def fill(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy `tensors` (CPU or not) into their regions; see the module contract."""
        if not self.matches(tensors):
            raise ValueError(
                f"tensors differ from this buffer's layout: {self._difference(tensors)}"
            )
        sources = [tensors[n].detach() for n in self.spec]
        with torch.no_grad():
            torch._foreach_copy_(self._targets, sources)

    def file_bytes(self) -> memoryview:
        """The whole safetensors file (a view of the buffer)."""
        return memoryview(self._buf_U8.numpy()).cast("B")

    def tensors(self) -> dict[str, torch.Tensor]:
        """name -> a view of its region (what the file holds now)."""
        return dict(self._views)

    @property
    def nbytes(self) -> int:
        return self._buf_U8.numel()

    def _difference(self, tensors: Mapping[str, torch.Tensor]) -> str:
        missing = [n for n in self.spec if n not in tensors]
        extra = [n for n in tensors if n not in self.spec]
        if missing or extra:
            return f"missing {missing[:3]}, unexpected {extra[:3]}"
        for n, t in tensors.items():
            if self.spec[n] != (t.dtype, tuple(t.shape)):
                return f"{n!r} is {t.dtype} {tuple(t.shape)}, the layout has {self.spec[n]}"
        return "none"
