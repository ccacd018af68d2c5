"""Loading new policy weights into a live model (the engine's hot-swap), validated first.

A load is two steps so that a bad source can never leave a model half-updated:
`prepare_weights(model, source)` reads the source and checks it completely (every parameter
present and nothing else, shapes, floating dtypes, every value finite) and returns tensors already
cast to the model's device and dtype; only then does `apply_weights` copy them in place. Reading
and checking happen on the caller's thread (the engine keeps decoding meanwhile); a source that
fails any check raises `ValueError` (or `OSError` for I/O) naming the file or tensor, and the
model is untouched.

Not covered: signatures (a writer of the source is trusted to write weights, not code: nothing
here executes or unpickles anything; safetensors only).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

WeightSource = Mapping[str, torch.Tensor] | str | Path
"""A state dict with HF names (per-expert or fused layout; `model.state_dict()` qualifies), an
HF-format directory (safetensors, single file or sharded), or the URL of one that fsspec can read
(s3://bucket/ckpt, file:///path, ...)."""


@dataclass(frozen=True)
class PreparedWeights:
    """A complete weight version in the model's own layout: internal (stacked-experts) names,
    the model's dtypes and device, every value checked finite. Built by `prepare_weights`, or by
    a receiver that checked the same (engine/weight_transport.py's staging); only then may
    `apply_weights` copy it in."""

    tensors: dict[str, torch.Tensor]


INDEX_MAX_BYTES = 64 << 20
"""A shard index names each tensor once (~100 bytes a name): 64 MiB is far beyond any model."""


def read_weights(source: WeightSource, max_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a source. A truncated or malformed safetensors file, or a shard index
    that is not JSON, names missing files or files outside the directory, or maps a tensor to
    a file that lacks it, is a ValueError naming it. With an index, its weight_map is the
    checkpoint: exactly the tensors it lists are read (so an incomplete map is incomplete).
    Only the files the index names (or the single model.safetensors) are read or, for a URL,
    copied, and their sizes together must stay within `max_bytes` (checked on the listing first).
    """
    from safetensors import SafetensorError

    if not isinstance(source, str | Path):
        return dict(source)
    try:
        if isinstance(source, str) and "://" in source:
            with tempfile.TemporaryDirectory(prefix="slipstream-weights-") as tmp:
                _download(source, Path(tmp), max_bytes)
                return _read_dir(Path(tmp), max_bytes)
        if not Path(source).is_dir():
            raise ValueError(f"update_weights: {source} is not a directory")
        return _read_dir(Path(source), max_bytes)
    except SafetensorError as e:
        raise ValueError(f"update_weights: {source}: unreadable safetensors: {e}") from None


def _files_named(where: str, index_text: str | None) -> dict[str, list[str]]:
    """file name -> tensor names it must hold, from a shard index (None: no index, then the
    single file, all its tensors). ValueError naming `where` for a bad index."""
    from slipstream.model.checkpoint import SINGLE_FILE

    if index_text is None:
        return {SINGLE_FILE: []}  # every tensor of the file
    try:
        weight_map = json.loads(index_text)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"update_weights: {where}: bad shard index: {e!r}") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(f"update_weights: {where}: bad shard index: weight_map must "
                         "map tensor names to file names")  # fmt: skip
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        if Path(fname).name != fname or not fname.endswith(".safetensors"):
            raise ValueError(f"update_weights: {where}: bad shard index: file "
                             f"{fname[:80]!r} is not a .safetensors file in the directory")  # fmt: skip
        by_file.setdefault(fname, []).append(name)
    return by_file


def _check_total(where: str, sizes: dict[str, int], max_bytes: int | None) -> None:
    total = sum(sizes.values())
    if max_bytes is not None and total > max_bytes:
        raise ValueError(f"update_weights: {where}: the files the index names hold {total} "
                         f"bytes, more than the limit of {max_bytes} "
                         "(engine.max_weight_source_bytes)")  # fmt: skip


def _read_dir(directory: Path, max_bytes: int | None = None) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    from slipstream.model.checkpoint import INDEX_FILE, SINGLE_FILE

    index_path = directory / INDEX_FILE
    if index_path.is_file():
        if index_path.stat().st_size > INDEX_MAX_BYTES:
            raise ValueError(f"update_weights: {index_path}: larger than {INDEX_MAX_BYTES} bytes")
        try:
            index_text = index_path.read_text()
        except UnicodeDecodeError as e:
            raise ValueError(f"update_weights: {index_path}: bad shard index: {e!r}") from None
        by_file = _files_named(str(index_path), index_text)
    elif (directory / SINGLE_FILE).is_file():
        by_file = _files_named(str(directory), None)
    else:
        raise FileNotFoundError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE}")
    sizes = {}
    for fname in by_file:
        path = directory / fname
        if not path.is_file():
            raise FileNotFoundError(f"No such file: {path} (named by {INDEX_FILE})")
        sizes[fname] = path.stat().st_size
    _check_total(str(directory), sizes, max_bytes)
    state: dict[str, torch.Tensor] = {}
    for fname, names in sorted(by_file.items()):
        path = directory / fname
        with safe_open(str(path), framework="pt", device="cpu") as f:
            present = set(f.keys())
            wanted = names or sorted(present)
            lacking = [n for n in wanted if n not in present]
            if lacking:
                raise ValueError(f"update_weights: {path} lacks {lacking[:5]} (named by the index)")
            for name in wanted:
                state[name] = f.get_tensor(name)
    return state


def default_max_source_bytes(model: torch.nn.Module) -> int:
    """4 x the model's parameter bytes + 64 MiB: an fp32 checkpoint of a bf16 model, with its
    headers, fits; anything much larger is not a checkpoint of this model."""
    params = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return 4 * params + (64 << 20)


def prepare_weights(
    model: torch.nn.Module, source: WeightSource, max_bytes: int | None = None
) -> PreparedWeights:
    """Read `source` and check it against `model` (see the module docstring); returns the
    internal (stacked-experts) state dict on the model's device and in its dtypes. `max_bytes`
    bounds the source's files (default: `default_max_source_bytes(model)`)."""
    from slipstream.model.checkpoint import hf_to_internal
    from slipstream.storage import check_finite

    state = read_weights(source, max_bytes or default_max_source_bytes(model))
    bad_type = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad_type:
        raise ValueError(f"update_weights: entries that are not tensors: {bad_type[:5]}")
    try:
        internal = hf_to_internal(state, model.config)
    except (KeyError, RuntimeError) as e:  # incomplete or mis-shaped per-expert tensors
        raise ValueError(f"update_weights: cannot stack the experts: {e}") from None
    params = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        internal.pop("lm_head.weight", None)
        params.pop("lm_head.weight", None)
    missing = sorted(set(params) - set(internal))
    unexpected = sorted(set(internal) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"update_weights: checkpoint mismatch: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
        )
    out: dict[str, torch.Tensor] = {}
    for name, t in internal.items():
        target = params[name]
        if tuple(t.shape) != tuple(target.shape):
            raise ValueError(
                f"update_weights: {name}: shape {tuple(t.shape)}, the model has "
                f"{tuple(target.shape)}"
            )
        if not t.is_floating_point():
            raise ValueError(f"update_weights: {name}: dtype {t.dtype} is not floating point")
        out[name] = t.to(device=target.device, dtype=target.dtype)
    # one fused norm per device (storage.check_finite): a per-tensor isfinite().all() took
    # 2.7 s per GB of bf16 on a Xeon core, longer than receiving the bytes over gloo
    check_finite(out, "update_weights")
    return PreparedWeights(out)


def apply_weights(model: torch.nn.Module, prepared: PreparedWeights) -> None:
    """Copy `prepare_weights` output into `model` in place (parameter identity kept)."""
    from slipstream.model.checkpoint import load_internal_state_dict

    # internal names and layout already (prepare_weights): no family mapping a second time
    load_internal_state_dict(model, prepared.tensors)  # type: ignore[arg-type]


def exchange_weights(model: torch.nn.Module, prepared: PreparedWeights) -> None:
    """`apply_weights` without the copy: each parameter takes the prepared tensor's storage
    and the prepared tensor takes the parameter's, so the caller's tensors hold the previous
    version afterwards (a receiver's staging, double-buffered). Parameter objects are kept, their
    storage is not: only for an engine whose captured graphs do not read parameter addresses.
    ValueError before anything moved for a name, shape, dtype or device that does not match."""
    params = dict(model.state_dict(keep_vars=True))
    pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, t in prepared.tensors.items():
        p = params.get(name)
        if p is None or (p.shape, p.dtype, p.device) != (t.shape, t.dtype, t.device):
            raise ValueError(f"exchange_weights: {name}: {tuple(t.shape)} {t.dtype} {t.device} "
                             f"does not match the model's parameter")  # fmt: skip
        pairs[id(p)] = (p, t)  # a tied parameter appears under two names: exchanged once
    with torch.no_grad():
        for p, t in pairs.values():
            p.data, t.data = t.data, p.data
    model.tie_weights()  # type: ignore[operator]


def load_weights_into(model: torch.nn.Module, source: WeightSource) -> None:
    """`prepare_weights` then `apply_weights`: strict and validated (missing or unexpected
    names, wrong shapes, non-float dtypes and non-finite values raise ValueError naming them;
    an unreadable source raises ValueError or OSError); the model is unchanged on failure."""
    apply_weights(model, prepare_weights(model, source))


def _download(url: str, directory: Path, max_bytes: int | None) -> None:
    """Copy the shard index and the files it names (or the single model.safetensors) of a
    checkpoint URL into `directory`; nothing else in the source is copied, and the named files'
    listed sizes must fit `max_bytes` before the first byte of them is fetched."""
    import fsspec

    from slipstream.model.checkpoint import INDEX_FILE, SINGLE_FILE

    fs, root = fsspec.core.url_to_fs(url)
    if not fs.isdir(root):
        raise ValueError(f"update_weights: {url} is not a directory")
    listed = {Path(p["name"]).name: int(p.get("size") or 0)
              for p in fs.ls(root, detail=True) if p.get("type") == "file"}  # fmt: skip
    root = root.rstrip("/")
    if INDEX_FILE in listed:
        if listed[INDEX_FILE] > INDEX_MAX_BYTES:
            raise ValueError(
                f"update_weights: {url}/{INDEX_FILE}: larger than {INDEX_MAX_BYTES} bytes"
            )
        index_bytes = fs.cat_file(f"{root}/{INDEX_FILE}")
        (directory / INDEX_FILE).write_bytes(index_bytes)
        by_file = _files_named(f"{url}/{INDEX_FILE}", index_bytes.decode(errors="replace"))
    elif SINGLE_FILE in listed:
        by_file = _files_named(url, None)
    else:
        raise ValueError(f"update_weights: {url} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    missing = sorted(set(by_file) - set(listed))
    if missing:
        raise FileNotFoundError(f"No such file: {url}/{missing[0]} (named by {INDEX_FILE})")
    _check_total(url, {f: listed[f] for f in by_file}, max_bytes)
    for fname in sorted(by_file):
        fs.get(f"{root}/{fname}", str(directory / fname))
