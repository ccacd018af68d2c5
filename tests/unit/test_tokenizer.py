"""Tokenizer round trips: the char vocabulary, its tokenizer.json as read by the `tokenizers`
library, and an HF tokenizer.json built inside the test."""

from __future__ import annotations

import json

import pytest

from slipstream.model.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer

tokenizers = pytest.importorskip("tokenizers")

TEXTS = ["", "123+456=579", "3 8 5 12 -> 29: 8*3+5", "(1+2)*3/4-5", "Hello, World!\n~"]


def test_char_round_trip_and_specials() -> None:
    tok = CharTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 3 + 96
    for text in TEXTS:
        ids = tok.encode(text)
        assert len(ids) == len(text)
        assert all(3 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    # Specials are dropped on decode, and distinct characters get distinct ids.
    assert tok.decode([tok.bos_id, *tok.encode("12"), tok.eos_id, tok.pad_id]) == "12"
    assert len(set(tok.encode("0123456789+-*/() "))) == 17


def test_char_rejects_unknown_character() -> None:
    with pytest.raises(ValueError, match="'é'"):
        CharTokenizer().encode("café")


def test_char_saved_file_is_read_identically_by_tokenizers_lib(tmp_path) -> None:
    tok = CharTokenizer()
    tok.save(tmp_path)
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in TEXTS:
        assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text)
        assert hf.decode(tok.encode(text)) == text
    assert hf.token_to_id("<eos>") == tok.eos_id
    # load_tokenizer on the directory returns the char tokenizer again, not the generic wrapper.
    again = load_tokenizer(tmp_path)
    assert isinstance(again, CharTokenizer)
    assert again.alphabet == tok.alphabet
    # ... and the generic HF wrapper reading the same file agrees too.
    wrapped = HFTokenizer(tmp_path / "tokenizer.json")
    assert (wrapped.bos_id, wrapped.eos_id, wrapped.pad_id) == (1, 2, 0)
    assert wrapped.vocab_size == tok.vocab_size
    assert wrapped.encode("12*3") == tok.encode("12*3")


def test_char_load_rejects_foreign_vocab(tmp_path) -> None:
    CharTokenizer().save(tmp_path)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["model"]["vocab"]["<bos>"], data["model"]["vocab"]["<eos>"] = 2, 1
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not a slipstream char vocabulary"):
        load_tokenizer(tmp_path)


def _wordlevel_file(path) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "!": 5, "12": 6}
    t = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    t.save(str(path))


def _bpe_file(path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    t.train_from_iterator(["12+34=46", "the quick brown fox", "Hello, World!"] * 50, trainer)
    t.save(str(path))


def test_hf_wordlevel_round_trip(tmp_path) -> None:
    _wordlevel_file(tmp_path / "tokenizer.json")
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)  # no pad token: pad falls back to EOS
    ids = tok.encode("hello world ! 12")
    assert ids == [3, 4, 5, 6]
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == "hello world ! 12"


def test_hf_bpe_round_trip_and_save(tmp_path) -> None:
    _bpe_file(tmp_path / "tokenizer.json")
    tok = load_tokenizer(tmp_path)  # a directory holding tokenizer.json
    assert tok.eos_id == tok.bos_id == 0  # <|endoftext|> plays both roles
    assert tok.pad_id == 1
    for text in ["12+34=46", "the quick brown fox", "unseen ~ text é"]:
        assert tok.decode(tok.encode(text)) == text
    out = tmp_path / "saved"
    tok.save(out)
    again = load_tokenizer(out)  # names from the saved tokenizer_config.json
    assert (again.bos_id, again.eos_id, again.pad_id) == (0, 0, 1)
    assert again.encode("the fox") == tok.encode("the fox")


def test_hf_missing_eos_and_missing_file(tmp_path) -> None:
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(
        str(tmp_path / "tokenizer.json")
    )
    with pytest.raises(ValueError, match="no EOS token"):
        load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="'</s>' is not in the vocabulary"):
        HFTokenizer(tmp_path / "tokenizer.json", eos_token="</s>")
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(tmp_path / "nope")


# ---- tokenization that travels with the checkpoint ---------------------------------------------

transformers = pytest.importorskip("transformers")


def _heldout_prompts(tok) -> tuple[list, object]:
    from pathlib import Path

    from slipstream.config import load_config
    from slipstream.tasks import get_taskset

    cfg = load_config(str(Path(__file__).resolve().parents[2] / "configs/quickstart.toml"), [])
    ts = get_taskset(cfg.task, tok)
    return ts.heldout(), ts


def test_transformers_tokenizer_from_the_export_gives_the_task_ids(tmp_path) -> None:
    """AutoTokenizer on the saved files encodes every held-out prompt to exactly the ids the
    tasks feed the model ([bos] + characters), with no BOS handling by the caller; decoding the
    model's completions (EOS included) gives the text the verifier sees."""
    tok = CharTokenizer()
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    tasks, ts = _heldout_prompts(tok)
    assert len(tasks) == 500
    for task in tasks:
        ids = ts.prompt_ids(task)
        assert hf(task.prompt)["input_ids"] == ids == tok.encode_prompt(task.prompt)
        completion = ts.completion_ids(ts.demonstration(task))
        assert hf.decode(completion, skip_special_tokens=True) == tok.decode(completion)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 0)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and config["add_eos_token"] is False
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    # The tokenizers library alone (what vLLM/SGLang use) applies the same post-processor.
    raw = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert raw.encode("12+34=").ids == tok.encode_prompt("12+34=")
    assert raw.encode("12+34=", add_special_tokens=False).ids == tok.encode("12+34=")


def test_chat_template_renders_the_training_format(tmp_path) -> None:
    tok = CharTokenizer()
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    one = [{"role": "user", "content": "12+34="}]
    assert tok.chat_prompt(one) == [tok.bos_id, *tok.encode("12+34=")]
    turns = [{"role": "system", "content": "S"}, *one, {"role": "assistant", "content": "46"},
             {"role": "user", "content": "1+1="}]  # fmt: skip
    for messages in (one, turns):
        hf_ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        hf_ids = hf_ids["input_ids"] if hasattr(hf_ids, "keys") else hf_ids
        assert hf_ids == tok.chat_prompt(messages)
    assert tok.chat_prompt(turns).count(tok.eos_id) == 1  # the assistant turn is closed


def test_special_token_strings_in_text_are_parsed_like_transformers(tmp_path) -> None:
    tok = CharTokenizer()
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ["a <eos> b", "<bos>12", "<pad><pad>", "<eo s>", ""]:
        assert hf(text)["input_ids"] == tok.encode_prompt(text)
    assert tok.encode("<eos>") != [tok.eos_id]  # task prompts never parse specials


def test_generation_config_is_not_overwritten(tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 8]}')
    CharTokenizer().save(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": [7, 8]}


def test_hf_tokenizer_keeps_its_own_behaviour(tmp_path) -> None:
    """A Qwen-like tokenizer (no BOS post-processor, its own chat template) served or saved by
    slipstream behaves as transformers says it does."""
    _bpe_file(tmp_path / "tokenizer.json")
    template = ("{% for m in messages %}<|pad|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>"
                "{% endfor %}{% if add_generation_prompt %}<|pad|>assistant\n{% endif %}")  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "pad_token": "<|pad|>", "chat_template": template,
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False}))  # fmt: skip
    tok = load_tokenizer(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ["12+34=", "the quick <|endoftext|> fox"]:
        assert tok.encode_prompt(text) == hf(text)["input_ids"]
    msgs = [{"role": "user", "content": "12+34="}]
    want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert tok.chat_prompt(msgs) == want
    out = tmp_path / "saved"
    tok.save(out)
    saved = json.loads((out / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == template and saved["add_bos_token"] is False
    again = transformers.AutoTokenizer.from_pretrained(str(out))
    assert again("12+34=")["input_ids"] == hf("12+34=")["input_ids"]


def test_chat_template_errors_are_value_errors(tmp_path) -> None:
    from slipstream.model.tokenizer import render_chat_template

    with pytest.raises(ValueError, match="only user"):
        render_chat_template("{{ raise_exception('only user') }}", [], True, "<s>", "</s>")
    _wordlevel_file(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(tmp_path / "tokenizer.json").chat_prompt([{"role": "user", "content": "x"}])
