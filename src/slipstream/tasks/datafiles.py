"""Data files read in blocks: the storage side of `task.name = "dataset"` (tasks/dataset.py).

    files = expand(["data/*.jsonl", "s3://bucket/x.parquet"], endpoint_url="", what="task.train_files[0]")
    for f in files:
        blocks = f.blocks(block_rows=256)      # one streaming pass: Block(file, index, start, rows)
        rows = f.read_block(block)             # list[dict], the block's rows, in file order

Paths are local paths, `file://` URLs or anything fsspec opens (`s3://` through s3fs, the
project's storage layer client); a path with glob characters is expanded (sorted; a glob matching
nothing is an error). Formats by suffix:

- `.parquet`: pyarrow (`ParquetFile.iter_batches` of `block_rows` rows per row group; a block is
  read by decoding its row group up to that batch, so memory is one batch, never the file);
- `.jsonl` / `.ndjson` and `.json` holding JSON lines: the stdlib json module per line (each row
  keeps its own types; no schema unification across rows). A block is a byte offset and a count
  of lines recorded during the one indexing pass;
- `.json` holding one array: read whole (a JSON array cannot be streamed without a streaming
  parser); say so in docs/data.md;
- `.csv`: the stdlib csv module; a block is the byte offset of a record (records may span lines:
  quoted newlines are tracked by quote parity, RFC 4180). Values are strings (CSV has no types).

Every failure is a `DataError` (a ConfigError: the CLI prints one line, exit 2) naming the file
and, for a bad row, its row number: unreadable file, empty file, a line that is not UTF-8 or not
JSON, a row that is not an object.

Not covered: compressed files (.gz, .zst), Arrow IPC, HF `datasets` save_to_disk directories.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec

from slipstream.config.base import ConfigError

GLOB_CHARS = "*?["
FORMATS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
}


class DataError(ConfigError):
    """A data file that cannot be used; the message names the file (and row) and why."""


@dataclass(frozen=True)
class Block:
    file: int
    """Index of the file within its source."""
    index: int
    """Block number within the file."""
    start: int
    """Row number (0-based, within the file) of the block's first row."""
    rows: int
    pos: Any = None
    """Where the block starts: a byte offset (JSON lines, CSV) or (row group, batch) (Parquet)."""


def _fs_options(url: str, endpoint_url: str) -> dict[str, Any]:
    if url.startswith("s3://") and endpoint_url:
        return {"client_kwargs": {"endpoint_url": endpoint_url}, "skip_instance_cache": True}
    return {}


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


@dataclass
class DataFile:
    """One data file on an fsspec filesystem."""

    url: str
    """As the user wrote it or as the glob expanded (with its scheme)."""
    fs: Any = field(repr=False)
    path: str
    """The filesystem's own path."""
    fmt: str
    _json_array: list[Any] | None = field(default=None, repr=False)
    _csv_header: list[str] | None = field(default=None, repr=False)

    def _open(self) -> Any:
        try:
            return self.fs.open(self.path, "rb")
        except FileNotFoundError:
            raise DataError(f"{self.url}: no such file") from None
        except PermissionError:
            raise DataError(f"{self.url}: permission denied (cannot read the file)") from None
        except IsADirectoryError:
            raise DataError(f"{self.url}: is a directory, not a data file") from None
        except OSError as e:
            raise DataError(f"{self.url}: cannot open: {_one_line(e)}") from None

    # -- indexing: one streaming pass that records where each block starts ---------------------

    def blocks(self, block_rows: int) -> list[Block]:
        try:
            if self.fmt == "parquet":
                out = self._parquet_blocks(block_rows)
            elif self.fmt == "csv":
                out = self._csv_blocks(block_rows)
            else:
                out = self._jsonl_blocks(block_rows)
        except DataError:
            raise
        except OSError as e:
            raise DataError(f"{self.url}: read error: {_one_line(e)}") from None
        if not out:
            raise DataError(f"{self.url}: empty file (no rows)")
        return out

    def _jsonl_blocks(self, block_rows: int) -> list[Block]:
        with self._open() as f:
            head = f.read(4096).lstrip()
            if self.fmt == "json" and head.startswith(b"["):
                return self._json_array_blocks(block_rows)
            f.seek(0)
            out: list[Block] = []
            offset, row, block_start, block_off = 0, 0, 0, 0
            for line in f:
                if line.strip():
                    if row - block_start == block_rows:
                        out.append(Block(0, len(out), block_start, row - block_start, block_off))
                        block_start, block_off = row, offset
                    row += 1
                elif row == block_start:
                    block_off = offset + len(line)
                offset += len(line)
            if row > block_start:
                out.append(Block(0, len(out), block_start, row - block_start, block_off))
            return out

    def _json_array_blocks(self, block_rows: int) -> list[Block]:
        with self._open() as f:
            raw = f.read()
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"{self.url}: not UTF-8 (byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{self.url}: not valid JSON: {e.msg} (line {e.lineno})") from None
        if not isinstance(data, list):
            raise DataError(
                f"{self.url}: a .json data file must hold an array of rows or JSON lines"
            )
        self._json_array = data
        return [
            Block(0, k, s, min(block_rows, len(data) - s), s)
            for k, s in enumerate(range(0, len(data), block_rows))
        ]

    def _csv_blocks(self, block_rows: int) -> list[Block]:
        with self._open() as f:
            header_line = f.readline()
            if not header_line.strip():
                return []
            self._csv_header = next(csv.reader([self._decode(header_line, 0)]))
            offset = len(header_line)
            out: list[Block] = []
            row, block_start, block_off, in_quotes, rec_start = 0, 0, offset, False, offset
            for line in f:
                if not in_quotes and not line.strip():
                    offset += len(line)
                    if row == block_start:
                        block_off = offset
                    continue
                if not in_quotes:
                    rec_start = offset
                if line.count(b'"') % 2:
                    in_quotes = not in_quotes
                offset += len(line)
                if in_quotes:
                    continue
                if row - block_start == block_rows:
                    out.append(Block(0, len(out), block_start, row - block_start, block_off))
                    block_start, block_off = row, rec_start
                row += 1
            if in_quotes:
                raise DataError(f"{self.url}:{row + 1}: unterminated quoted field")
            if row > block_start:
                out.append(Block(0, len(out), block_start, row - block_start, block_off))
            return out

    def _parquet_file(self, f: Any) -> Any:
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(f)
        except (ValueError, OSError) as e:  # pyarrow.ArrowInvalid is a ValueError
            raise DataError(f"{self.url}: not a Parquet file: {_one_line(e)}") from None

    def _parquet_blocks(self, block_rows: int) -> list[Block]:
        with self._open() as f:
            meta = self._parquet_file(f).metadata
        out: list[Block] = []
        start = 0
        for rg in range(meta.num_row_groups):
            n = meta.row_group(rg).num_rows
            for b, s in enumerate(range(0, n, block_rows)):
                rows = min(block_rows, n - s)
                out.append(Block(0, len(out), start + s, rows, (rg, b)))
            start += n
        return out

    # -- reading ----------------------------------------------------------------------------

    def read_block(self, block: Block, block_rows: int) -> list[dict[str, Any]]:
        """The block's rows as dicts, in file order. Raises DataError naming the bad row."""
        try:
            if self.fmt == "parquet":
                return self._read_parquet(block, block_rows)
            if self._json_array is not None:
                rows = self._json_array[block.pos : block.pos + block.rows]
                for k, r in enumerate(rows):
                    self._check_object(r, block.start + k)
                return rows
            if self.fmt == "csv":
                return self._read_csv(block)
            return self._read_jsonl(block)
        except DataError:
            raise
        except OSError as e:
            raise DataError(f"{self.url}: read error: {_one_line(e)}") from None

    def iter_rows(
        self, block_rows: int, blocks: list[Block]
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        """(row number, row) for every row, block by block (bounded memory)."""
        for block in blocks:
            for k, row in enumerate(self.read_block(block, block_rows)):
                yield block.start + k, row

    def _decode(self, line: bytes, row: int) -> str:
        try:
            return line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"{self.url}:{row + 1}: not UTF-8 (byte {e.start} of the row)"
            ) from None

    def _check_object(self, value: Any, row: int) -> None:
        if not isinstance(value, dict):
            raise DataError(
                f"{self.url}:{row + 1}: a row must be a JSON object, got {type(value).__name__}"
            )

    def _read_jsonl(self, block: Block) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        with self._open() as f:
            f.seek(block.pos)
            for line in f:
                if not line.strip():
                    continue
                row = block.start + len(rows)
                try:
                    value = json.loads(self._decode(line, row))
                except json.JSONDecodeError as e:
                    raise DataError(f"{self.url}:{row + 1}: not valid JSON: {e.msg}") from None
                self._check_object(value, row)
                rows.append(value)
                if len(rows) == block.rows:
                    break
        return rows

    def _read_csv(self, block: Block) -> list[dict[str, Any]]:
        assert self._csv_header is not None
        header = self._csv_header
        with self._open() as f:
            f.seek(block.pos)
            lines: list[str] = []
            in_quotes, records = False, 0
            for line in f:
                if not in_quotes and not line.strip():
                    continue
                lines.append(self._decode(line, block.start + records))
                if line.count(b'"') % 2:
                    in_quotes = not in_quotes
                if not in_quotes:
                    records += 1
                    if records == block.rows:
                        break
        rows: list[dict[str, Any]] = []
        for values in csv.reader(io.StringIO("".join(lines))):
            row = block.start + len(rows)
            if len(values) != len(header):
                raise DataError(
                    f"{self.url}:{row + 1}: {len(values)} fields, the header has {len(header)}"
                )
            rows.append(dict(zip(header, values, strict=True)))
        return rows

    def _read_parquet(self, block: Block, block_rows: int) -> list[dict[str, Any]]:
        rg, b = block.pos
        with self._open() as f:
            pf = self._parquet_file(f)
            for k, batch in enumerate(pf.iter_batches(batch_size=block_rows, row_groups=[rg])):
                if k == b:
                    return batch.to_pylist()
        raise DataError(f"{self.url}: row group {rg} has fewer rows than its metadata says")


def expand(entry: str, endpoint_url: str, what: str) -> list[DataFile]:
    """The files of one `train_files`/`heldout_files` entry (a path, URL or glob), sorted."""
    opts = _fs_options(entry, endpoint_url)
    try:
        fs, _, paths = fsspec.get_fs_token_paths(entry, storage_options=opts)
    except (ImportError, ValueError) as e:
        raise DataError(f"{what} = {entry!r}: {_one_line(e)}") from None
    except OSError as e:
        raise DataError(f"{what} = {entry!r}: {_one_line(e)}") from None
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    has_glob = any(c in entry for c in GLOB_CHARS)
    if not paths:
        raise DataError(f"{what} = {entry!r}: the glob matches no file")
    if not has_glob:
        try:
            exists = fs.exists(paths[0])
        except OSError as e:
            raise DataError(f"{what} = {entry!r}: {_one_line(e)}") from None
        if not exists:
            raise DataError(f"{what} = {entry!r}: no such file")
    out: list[DataFile] = []
    for path in sorted(paths):
        if fs.isdir(path):
            if has_glob:
                continue
            raise DataError(f"{what} = {entry!r}: is a directory; name its files or a glob")
        ext = os.path.splitext(path)[1].lower()
        fmt = FORMATS.get(ext)
        if fmt is None:
            raise DataError(
                f"{what}: {path}: unknown format {ext or '(no suffix)'!r}; expected one of "
                f"{', '.join(sorted(FORMATS))}"
            )
        url = path if protocol in ("file", "local") else f"{protocol}://{path}"
        out.append(DataFile(url, fs, path, fmt))
    if not out:
        raise DataError(f"{what} = {entry!r}: the glob matches no file")
    return out
