"""Tokenizers: a fixed character-level vocabulary for the built-in tasks, and Hugging Face
`tokenizer.json` files loaded through the `tokenizers` library (the `hf` extra, imported lazily).

Contract (`Tokenizer` protocol): `encode(text) -> ids` adds no special tokens and parses none
(what tasks build prompts from: `[bos_id, *encode(prompt)]`); `decode(ids) -> text` drops special
tokens; `encode_prompt(text)` is what a client's text prompt becomes (special-token strings in the
text parsed to their ids, then the tokenizer's post-processor: BOS for the char vocabulary);
`chat_prompt(messages)` renders the tokenizer's chat template and encodes it; `bos_id`, `eos_id`,
`pad_id`, `vocab_size`; `save(directory)` writes files that `load_tokenizer(directory)` reads back.

The character tokenizer saves itself as a real `tokenizer.json` (a BPE model with single-character
vocabulary, no merges, a Fuse decoder and a TemplateProcessing post-processor that adds `<bos>`, the
way Llama's tokenizer.json declares its BOS), so `tokenizers` and transformers read a slipstream
checkpoint's tokenizer with identical ids: `AutoTokenizer.from_pretrained(dir)(prompt).input_ids`
is exactly `[bos_id, *encode(prompt)]`, the ids the tasks feed the model. `tokenizer_config.json`
states `add_bos_token`, the special tokens and a chat template (`CHAR_CHAT_TEMPLATE`), and marks
the file as slipstream's char vocabulary; `generation_config.json` (written only when the
directory has none) names the BOS/EOS/pad ids so `model.generate` stops at EOS.

An HF tokenizer keeps its own behaviour: its post-processor decides what `encode_prompt` adds, its
`tokenizer_config.json` (or `chat_template.jinja`) holds the chat template, and `save` keeps both.

Not covered: byte fallback; multimodal chat content; chat templates that need transformers'
extra globals beyond `raise_exception`, `strftime_now` and the `tojson` filter.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
# Newline plus printable ASCII: enough for every built-in task's prompts and answers.
CHAR_ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
# The char models' training format is `<bos> prompt completion <eos>`, so a chat renders as BOS,
# then every system/user message's text verbatim, assistant turns closed by EOS; the generation
# prompt adds nothing (the model continues right after the user's text). A user message "12+34="
# therefore becomes exactly the ids of the task prompt "12+34=".
CHAR_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)
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
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...
    def encode_prompt(self, text: str) -> list[int]: ...
    def chat_prompt(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]: ...
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

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Characters of `ids`; ids outside the vocabulary are dropped, special tokens too
        unless `skip_special_tokens` is False (then "<bos>" etc., as transformers writes them)."""
        specials = {} if skip_special_tokens else dict(enumerate(self.specials))
        return "".join(self._id_to_char.get(int(i), specials.get(int(i), "")) for i in ids)

    def encode_with_specials(self, text: str) -> list[int]:
        """`encode`, except that the special-token strings "<pad>", "<bos>", "<eos>" in the text
        become their ids (as the `tokenizers` library does with added tokens)."""
        ids: list[int] = []
        for piece in _SPECIAL_RE.split(text):
            if piece in self.specials:
                ids.append(self.specials.index(piece))
            elif piece:
                ids.extend(self.encode(piece))
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """A client's text prompt: `[bos_id, *encode_with_specials(text)]`, what a transformers
        tokenizer loaded from `save()`'s files gives for `tok(text).input_ids`."""
        return [self.bos_id, *self.encode_with_specials(text)]

    def chat_prompt(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        """`CHAR_CHAT_TEMPLATE` rendered and encoded (special-token strings parsed, no BOS added:
        the template has it), as transformers' `apply_chat_template(tokenize=True)`. The char
        template renders no tools."""
        text = render_chat_template(
            CHAR_CHAT_TEMPLATE, messages, add_generation_prompt, BOS, EOS, PAD, tools=tools
        )
        return self.encode_with_specials(text)

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
            "post_processor": _bos_post_processor(BOS, self.bos_id),
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
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAR_CHAT_TEMPLATE,
            "model_max_length": 1_000_000,
        }
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=1))
        specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
        (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=1))
        _write_generation_config(directory, self.bos_id, self.eos_id, self.pad_id)

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
        self._config: dict[str, Any] = config
        self.chat_template: str | None = _chat_template_of(config, self.path.parent)
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

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def encode_prompt(self, text: str) -> list[int]:
        """The file's own behaviour: added/special tokens in the text parsed, then its
        post-processor (whatever BOS/EOS the tokenizer declares; nothing for e.g. Qwen)."""
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def chat_prompt(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The tokenizer's chat template rendered and encoded without the post-processor (the
        template carries its own specials), as transformers' apply_chat_template does; `tools`
        (OpenAI function definitions) reach the template as its `tools` variable."""
        if self.chat_template is None:
            raise ValueError(f"{self.path.parent}: the tokenizer has no chat template")
        names = {r: self._tok.id_to_token(i) for r, i in self._ids.items()}
        text = render_chat_template(
            self.chat_template, messages, add_generation_prompt,
            names["bos"], names["eos"], names["pad"], tools=tools,
        )  # fmt: skip
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def save(self, directory: str | Path) -> None:
        """tokenizer.json, the original tokenizer_config.json (chat template, add_bos_token and
        the rest kept) with the special-token names this wrapper resolved, and
        generation_config.json when the directory has none."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(directory / TOKENIZER_FILE))
        names = {r: self._tok.id_to_token(i) for r, i in self._ids.items()}
        config = dict(self._config)
        config.update({f"{r}_token": n for r, n in names.items()})
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=1))
        _write_generation_config(directory, self.bos_id, self.eos_id, self.pad_id)


_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in (PAD, BOS, EOS)) + ")")


def _bos_post_processor(bos: str, bos_id: int) -> dict[str, Any]:
    """tokenizers' TemplateProcessing that puts BOS before each sequence (Llama's layout)."""
    return {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }


def _write_generation_config(directory: Path, bos_id: int, eos_id: int, pad_id: int) -> None:
    """generation_config.json naming the special ids (so HF `generate` stops at EOS), only where
    the directory has none: a model's own generation settings are never overwritten."""
    path = directory / GENERATION_CONFIG_FILE
    if not path.exists():
        ids = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
        path.write_text(json.dumps(ids, indent=1))


def _chat_template_of(config: dict[str, Any], directory: Path) -> str | None:
    """The chat template of a tokenizer directory: tokenizer_config.json's `chat_template` (a
    string, or a list of named templates: the "default" one), else chat_template.jinja."""
    entry = config.get("chat_template")
    if isinstance(entry, list):
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
        entry = named.get("default")
    if isinstance(entry, str):
        return entry
    path = directory / CHAT_TEMPLATE_FILE
    return path.read_text() if path.is_file() else None


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str) -> Any:
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "chat templates need the `jinja2` package: pip install 'slipstream[serve]'"
        ) from e

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env.from_string(template)


def render_chat_template(
    template: str,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool,
    bos_token: str | None,
    eos_token: str | None,
    pad_token: str | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
) -> str:
    """Render a Hugging Face chat template in a sandboxed Jinja environment with the variables
    transformers passes (messages, add_generation_prompt, bos/eos/pad token strings, `tools`
    when given). A template error (including the template's own `raise_exception`) is a
    ValueError naming it."""
    from jinja2.exceptions import TemplateError

    try:
        return _compiled_template(template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            pad_token=pad_token or "",
            **({"tools": list(tools)} if tools else {}),
        )
    except TemplateError as e:
        raise ValueError(f"chat template: {e}") from None


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
