"""Tokenizers: a fixed character-level vocabulary for the built-in tasks, and Hugging Face
`tokenizer.json` files loaded through the `tokenizers` library (the `hf` extra, imported lazily).

Contract (`Tokenizer` protocol): `encode(text) -> ids` adds no special tokens; `decode(ids) -> text`
drops special tokens; `bos_id`, `eos_id`, `pad_id`, `vocab_size`; `save(directory)` writes files that
`load_tokenizer(directory)` reads back.

The character tokenizer saves itself as a real `tokenizer.json` (a BPE model with single-character
vocabulary, no merges and a Fuse decoder), so `tokenizers.Tokenizer.from_file` and therefore
transformers read a slipstream checkpoint's tokenizer with identical ids; `tokenizer_config.json`
names the special tokens and marks the file as slipstream's char vocabulary.

Not covered: chat templates, byte fallback, and parsing special-token strings out of text (the
char tokenizer encodes "<eos>" as five characters; the HF tokenizer follows its own file).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
# Newline plus printable ASCII: enough for every built-in task's prompts and answers.
CHAR_ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
# Special-token names tried, in order, when a tokenizer.json comes without tokenizer_config.json.
_CANDIDATES = {
    "bos": ["<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "<|endoftext|>"],
    "eos": ["<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|end_of_text|>", "<|eot_id|>"],
    "pad": ["<pad>", "<|pad|>", "[PAD]", "<|endoftext|>"],
}


@runtime_checkable
class Tokenizer(Protocol):
    """What the model, SFT, eval and the RL loop need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def bos_id(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def save(self, directory: str | Path) -> None: ...


class CharTokenizer:
    """One id per character of a fixed alphabet; <pad>=0, <bos>=1, <eos>=2, then the characters.

    `encode` raises ValueError naming the first character outside the alphabet (prompts are ours, so
    an unknown character is a bug, not something to map silently to <unk>)."""

    def __init__(self, alphabet: str = CHAR_ALPHABET) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("CharTokenizer alphabet has repeated characters")
        self.alphabet = alphabet
        self.specials = [PAD, BOS, EOS]
        self._char_to_id = {c: i + len(self.specials) for i, c in enumerate(alphabet)}
        self._id_to_char = {i: c for c, i in self._char_to_id.items()}

    @property
    def vocab_size(self) -> int:
        return len(self.specials) + len(self.alphabet)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    def encode(self, text: str) -> list[int]:
        try:
            return [self._char_to_id[c] for c in text]
        except KeyError as e:
            raise ValueError(
                f"CharTokenizer: character {e.args[0]!r} is not in the vocabulary"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        """Characters of `ids`; special tokens and ids outside the vocabulary are dropped."""
        return "".join(self._id_to_char.get(int(i), "") for i in ids)

    def to_hf_json(self) -> dict[str, Any]:
        """The `tokenizers` library's serialisation of this vocabulary (BPE, no merges, Fuse)."""
        vocab = {tok: i for i, tok in enumerate(self.specials)}
        vocab.update(self._char_to_id)
        added = [
            {
                "id": i,
                "content": tok,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, tok in enumerate(self.specials)
        ]
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": None,
            "post_processor": None,
            "decoder": {"type": "Fuse"},
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": False,
                "vocab": vocab,
                "merges": [],
            },
        }

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / TOKENIZER_FILE).write_text(json.dumps(self.to_hf_json(), indent=1))
        config = {
            "slipstream_tokenizer": "char",
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "model_max_length": 1_000_000,
        }
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=1))

    @classmethod
    def from_hf_json(cls, data: dict[str, Any], origin: str) -> CharTokenizer:
        """Rebuild from a saved tokenizer.json; fails if it is not a char vocabulary we wrote."""
        vocab: dict[str, int] = data["model"]["vocab"]
        by_id = sorted(vocab.items(), key=lambda kv: kv[1])
        if [i for _, i in by_id] != list(range(len(by_id))) or [t for t, _ in by_id[:3]] != [
            PAD,
            BOS,
            EOS,
        ]:
            raise ValueError(f"{origin}: not a slipstream char vocabulary (ids or specials differ)")
        alphabet = "".join(t for t, _ in by_id[3:])
        if any(len(t) != 1 for t, _ in by_id[3:]):
            raise ValueError(f"{origin}: char vocabulary has multi-character tokens")
        return cls(alphabet)


class HFTokenizer:
    """A Hugging Face `tokenizer.json` through the `tokenizers` library.

    Special tokens come from the arguments, else `tokenizer_config.json` next to the file, else the
    first of the usual names present in the vocabulary; a missing EOS is an error. A missing pad
    falls back to EOS (the usual causal-LM convention)."""

    def __init__(
        self,
        path: str | Path,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(
                "loading a tokenizer.json needs the `tokenizers` package: pip install 'slipstream[hf]'"
            ) from e
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file {self.path} does not exist")
        self._tok = _HF.from_file(str(self.path))
        self._json = json.loads(self.path.read_text())
        config_path = self.path.parent / CONFIG_FILE
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        given = {"bos": bos_token, "eos": eos_token, "pad": pad_token}
        self._ids: dict[str, int | None] = {}
        for role in ("bos", "eos", "pad"):
            name = given[role] or _token_name(config.get(f"{role}_token"))
            names = [name] if name else _CANDIDATES[role]
            found = [
                self._tok.token_to_id(n) for n in names if self._tok.token_to_id(n) is not None
            ]
            if name and not found:
                raise ValueError(f"{self.path}: {role} token {name!r} is not in the vocabulary")
            self._ids[role] = found[0] if found else None
        if self._ids["eos"] is None:
            raise ValueError(f"{self.path}: no EOS token found; pass eos_token= explicitly")
        if self._ids["pad"] is None:
            self._ids["pad"] = self._ids["eos"]
        if self._ids["bos"] is None:
            self._ids["bos"] = self._ids["eos"]

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int:
        return int(self._ids["bos"])  # type: ignore[arg-type]

    @property
    def eos_id(self) -> int:
        return int(self._ids["eos"])  # type: ignore[arg-type]

    @property
    def pad_id(self) -> int:
        return int(self._ids["pad"])  # type: ignore[arg-type]

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(directory / TOKENIZER_FILE))
        names = {r: self._tok.id_to_token(i) for r, i in self._ids.items()}
        config = {f"{r}_token": n for r, n in names.items()}
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=1))


def _token_name(entry: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}."""
    if isinstance(entry, dict):
        return entry.get("content")
    return entry if isinstance(entry, str) else None


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """`"char"` -> the built-in CharTokenizer; a directory -> the tokenizer saved there (a slipstream
    char vocabulary, or any HF tokenizer.json); a file path -> that HF tokenizer.json."""
    if str(spec) == "char":
        return CharTokenizer()
    path = Path(spec)
    if path.is_dir():
        config_path = path / CONFIG_FILE
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        if config.get("slipstream_tokenizer") == "char":
            data = json.loads((path / TOKENIZER_FILE).read_text())
            return CharTokenizer.from_hf_json(data, str(path / TOKENIZER_FILE))
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer {str(spec)!r}: expected 'char', a directory with {TOKENIZER_FILE}, "
            f"or a {TOKENIZER_FILE} file"
        )
    return HFTokenizer(path)
