"""Trainer state without pickle: tensors in one safetensors file, everything else as JSON.

    tensors_bytes, tree_bytes = encode_state(trainer.state_dict())
    state = decode_state(tensors_bytes, tree_bytes)      # equal to the input, bit for bit

`encode_state` takes a tree of dicts, lists, tuples, None, bool, int, float (NaN/inf included),
str, bytes, torch tensors and numpy arrays: exactly what `Trainer.state_dict()` holds (model,
optimizer and scheduler state dicts, the RNG state of `rng_state()` with python's tuple of ints
and numpy's uint32 array, the step; optionally critic and reference model). Tensors become
entries `t0`, `t1`, ... of the safetensors file (dtype, shape and bytes kept; moved to the CPU;
tensors sharing storage, e.g. tied weights, are stored apart); the JSON keeps the tree, with
one-key tagged objects for what JSON lacks:

    {"__tensor__": "t3"}  {"__tuple__": [...]}  {"__float__": "nan" | "inf" | "-inf"}
    {"__dict__": [[key, value], ...]}  (a dict with a key that is not a string or starts "__")
    {"__odict__": {"items": <dict>, "metadata": <dict> | null}}  (an OrderedDict, e.g. a module's
        state_dict, with its `_metadata`: the per-module versions load_state_dict reads)
    {"__ndarray__": {"dtype": "<u4", "shape": [624], "b64": ...}}  {"__bytes__": "<b64>"}

Decoding is strict: unknown tags, references to missing tensors, unhashable keys, numpy dtypes
outside a fixed numeric allowlist, sizes that do not match, or anything not produced by
`encode_state` are `InvalidEntry` errors naming `where`; nothing is ever executed or imported.

Not covered: tensor subclasses (DTensor: the sharded trainer writes DCP instead), sparse or
quantized tensors, object arrays, devices (everything comes back on the CPU; the trainer's
`load_state_dict` moves it), `requires_grad` flags.
"""

from __future__ import annotations

import base64
import json
import math
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from slipstream.storage.errors import InvalidEntry

FORMAT = "slipstream-trainer-state"
FORMAT_VERSION = 1
_NDARRAY_DTYPES = {"|b1", "|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8",
                   "<f2", "<f4", "<f8"}  # fmt: skip
_TAGS = {"__tensor__", "__tuple__", "__float__", "__dict__", "__odict__", "__ndarray__",
         "__bytes__"}  # fmt: skip
_MAX_DEPTH = 64


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.storages: set[int] = set()

    def tensor(self, t: torch.Tensor, path: str) -> dict[str, str]:
        if t.layout != torch.strided or t.is_quantized or type(t) is not torch.Tensor:
            raise TypeError(f"trainer state at {path}: a {type(t).__name__} with layout "
                            f"{t.layout} cannot be stored (dense tensors only)")  # fmt: skip
        c = t.detach().cpu().contiguous()
        ptr = c.untyped_storage().data_ptr()
        if c.numel() and ptr in self.storages:
            c = c.clone()  # shared storage (tied weights): safetensors wants them apart
        self.storages.add(c.untyped_storage().data_ptr())
        name = f"t{len(self.tensors)}"
        self.tensors[name] = c
        return {"__tensor__": name}

    def encode(self, obj: Any, path: str, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise TypeError(f"trainer state at {path}: nested deeper than {_MAX_DEPTH}")
        if obj is None or isinstance(obj, bool | int | str):
            return obj
        if isinstance(obj, float):
            if math.isfinite(obj):
                return obj
            return {"__float__": "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if isinstance(obj, np.ndarray):
            return {"__ndarray__": _encode_ndarray(obj, path)}
        if isinstance(obj, bytes):
            return {"__bytes__": base64.b64encode(obj).decode()}
        if isinstance(obj, list):
            return [self.encode(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return {"__tuple__": [self.encode(v, f"{path}[{i}]", depth + 1)
                                  for i, v in enumerate(obj)]}  # fmt: skip
        if isinstance(obj, OrderedDict):
            meta = getattr(obj, "_metadata", None)
            return {"__odict__": {
                "items": self.encode(dict(obj), path, depth + 1),
                "metadata": None if meta is None else self.encode(dict(meta), f"{path}/<meta>",
                                                                  depth + 1)}}  # fmt: skip
        if isinstance(obj, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in obj):
                return {k: self.encode(v, f"{path}/{k}", depth + 1) for k, v in obj.items()}
            return {"__dict__": [[self.encode(k, f"{path}/<key>", depth + 1),
                                  self.encode(v, f"{path}/{k}", depth + 1)]
                                 for k, v in obj.items()]}  # fmt: skip
        raise TypeError(f"trainer state at {path}: cannot store a {type(obj).__name__} "
                        "without pickle")  # fmt: skip


def _encode_ndarray(a: np.ndarray, path: str) -> dict[str, Any]:
    le = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False)
    if le.dtype.str not in _NDARRAY_DTYPES:
        raise TypeError(f"trainer state at {path}: numpy dtype {a.dtype} is not storable")
    return {"dtype": le.dtype.str, "shape": list(le.shape),
            "b64": base64.b64encode(le.tobytes()).decode()}  # fmt: skip


def encode_state(state: Any) -> tuple[bytes, bytes]:
    """(safetensors bytes, JSON bytes) of a trainer state tree; TypeError naming the path of
    anything that cannot be stored without pickle."""
    enc = _Encoder()
    tree = enc.encode(state, "")
    doc = {"format": FORMAT, "version": FORMAT_VERSION, "tree": tree}
    return st_save(enc.tensors), json.dumps(doc, allow_nan=False).encode()


class _Decoder:
    def __init__(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        self.tensors = tensors
        self.used: set[str] = set()
        self.where = where

    def bad(self, path: str, why: str) -> InvalidEntry:
        return InvalidEntry(f"{self.where}: at {path or '/'}: {why}")

    def decode(self, v: Any, path: str, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise self.bad(path, f"nested deeper than {_MAX_DEPTH}")
        if v is None or isinstance(v, bool | int | float | str):
            return v
        if isinstance(v, list):
            return [self.decode(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
        if not isinstance(v, dict):
            raise self.bad(path, f"unexpected JSON value {v!r:.80}")
        tagged = [k for k in v if k.startswith("__")]
        if not tagged:
            return {k: self.decode(x, f"{path}/{k}", depth + 1) for k, x in v.items()}
        if len(v) != 1 or tagged[0] not in _TAGS:
            raise self.bad(path, f"unknown tagged object with keys {sorted(v)[:5]}")
        tag, body = tagged[0], v[tagged[0]]
        if tag == "__tensor__":
            if not isinstance(body, str) or body not in self.tensors:
                raise self.bad(path, f"reference to a tensor {body!r:.40} the file does not hold")
            self.used.add(body)
            return self.tensors[body]
        if tag == "__tuple__":
            if not isinstance(body, list):
                raise self.bad(path, "__tuple__ is not a list")
            return tuple(self.decode(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(body))
        if tag == "__float__":
            if body not in ("nan", "inf", "-inf"):
                raise self.bad(path, f"__float__ {body!r:.20} is not nan/inf/-inf")
            return float(body)
        if tag == "__bytes__":
            return self.b64(body, path)
        if tag == "__ndarray__":
            return self.ndarray(body, path)
        if tag == "__odict__":
            return self.odict(body, path, depth)
        return self.dict_items(body, path, depth)

    def odict(self, body: Any, path: str, depth: int) -> OrderedDict[Any, Any]:
        if not isinstance(body, dict) or set(body) != {"items", "metadata"}:
            raise self.bad(path, "__odict__ needs exactly items and metadata")
        items = self.decode(body["items"], path, depth + 1)
        meta = self.decode(body["metadata"], f"{path}/<meta>", depth + 1)
        if not isinstance(items, dict) or not (meta is None or isinstance(meta, dict)):
            raise self.bad(path, "__odict__ items/metadata are not dicts")
        out = OrderedDict(items)
        if meta is not None:
            out._metadata = OrderedDict(meta)  # type: ignore[attr-defined]
        return out

    def b64(self, body: Any, path: str) -> bytes:
        if not isinstance(body, str):
            raise self.bad(path, "base64 payload is not a string")
        try:
            return base64.b64decode(body, validate=True)
        except ValueError as e:
            raise self.bad(path, f"bad base64 ({e})") from None

    def ndarray(self, body: Any, path: str) -> np.ndarray:
        if not isinstance(body, dict) or set(body) != {"dtype", "shape", "b64"}:
            raise self.bad(path, "__ndarray__ needs exactly dtype, shape, b64")
        dtype, shape = body["dtype"], body["shape"]
        if dtype not in _NDARRAY_DTYPES:
            raise self.bad(path, f"numpy dtype {dtype!r:.20} is not allowed")
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
            raise self.bad(path, f"bad ndarray shape {shape!r:.60}")
        data = self.b64(body["b64"], path)
        dt = np.dtype(dtype)
        if len(data) != math.prod(shape) * dt.itemsize:
            raise self.bad(path, f"{len(data)} bytes for an array of shape {shape} {dtype}")
        return np.frombuffer(data, dtype=dt).reshape(shape).copy()

    def dict_items(self, body: Any, path: str, depth: int) -> dict[Any, Any]:
        if not isinstance(body, list):
            raise self.bad(path, "__dict__ is not a list of pairs")
        out: dict[Any, Any] = {}
        for i, pair in enumerate(body):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise self.bad(f"{path}[{i}]", "__dict__ entry is not a [key, value] pair")
            key = self.decode(pair[0], f"{path}/<key {i}>", depth + 1)
            try:
                hash(key)
            except TypeError:
                raise self.bad(path, f"unhashable key {key!r:.40}") from None
            out[key] = self.decode(pair[1], f"{path}/{key}", depth + 1)
        return out


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def decode_state(tensors_bytes: bytes, tree_bytes: bytes, where: str = "trainer state") -> Any:
    """The tree `encode_state` wrote; InvalidEntry naming `where` for anything else."""
    try:
        tensors = st_load(tensors_bytes)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise InvalidEntry(f"{where}: tensors are not a valid safetensors file ({e})") from None
    try:
        doc = json.loads(tree_bytes.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InvalidEntry(f"{where}: state is not JSON ({type(e).__name__}: {e})") from None
    if not (isinstance(doc, dict) and doc.get("format") == FORMAT and "tree" in doc):
        raise InvalidEntry(f"{where}: not a {FORMAT} document")
    if doc.get("version") != FORMAT_VERSION:
        raise InvalidEntry(f"{where}: {FORMAT} version {doc.get('version')!r} is not "
                           f"{FORMAT_VERSION}")  # fmt: skip
    dec = _Decoder(tensors, where)
    try:
        state = dec.decode(doc["tree"], "")
    except RecursionError:
        raise InvalidEntry(f"{where}: state nested too deeply") from None
    unused = sorted(set(tensors) - dec.used)
    if unused:
        raise InvalidEntry(f"{where}: tensors {unused[:5]} are not referenced by the state")
    return state
