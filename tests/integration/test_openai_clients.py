"""Real clients against the real server (uvicorn on loopback): the official `openai` SDK
(completions, chat, streaming, logprobs, echo, models, errors) and an SGLang-style `/generate`
client (plain httpx: batch, streaming SSE, logprobs), each compared with what the engine gives
on the model's training prompt format (`TaskSet.prompt_ids`: BOS + the task prompt)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from test_server import Server

from slipstream.config.engine import EngineConfig
from slipstream.config.model import ModelConfig
from slipstream.config.task import TaskConfig
from slipstream.engine import GenerateRequest, NativeEngine, SamplingParams
from slipstream.engine.guard import ServeOptions
from slipstream.model import MoEForCausalLM
from slipstream.model.tokenizer import CharTokenizer
from slipstream.tasks import get_taskset
from slipstream.tasks.base import Task

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
torch.set_num_threads(1)

TOK = CharTokenizer()
NAME = "tiny-char-moe"
PROMPTS = ["12+34=", "7-5=", "99+1="]


@pytest.fixture(scope="module")
def model() -> MoEForCausalLM:
    torch.manual_seed(3)
    cfg = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                      max_position_embeddings=128, initializer_range=0.2)  # fmt: skip
    return MoEForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def served(model):
    from slipstream.engine.server import create_app

    cfg = EngineConfig(kv_cache_tokens=8 * 64, max_seq_len=64, max_batch_size=8)
    engine = NativeEngine(model, cfg, tokenizer=TOK)
    app = create_app(engine, TOK, "/some/local/dir", ServeOptions(served_model_name=NAME))
    with Server(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        yield server, client, engine
    engine.close()


def training_format_greedy(engine: NativeEngine, prompt: str, max_new: int) -> list[int]:
    """What the model answers on its training prompt format: the task's own prompt ids."""
    ts = get_taskset(TaskConfig(name="arithmetic"), TOK)
    ids = ts.prompt_ids(Task("arithmetic/x/0", prompt, prompt))
    assert ids == [TOK.bos_id, *TOK.encode(prompt)]
    (c,) = engine.generate([GenerateRequest(ids, SamplingParams(temperature=0,
                                                                max_new_tokens=max_new))])  # fmt: skip
    return c.token_ids


def test_models_lists_the_served_name_not_a_path(served):
    _, client, _ = served
    ids = [m.id for m in client.models.list()]
    assert ids == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_completions_greedy_answers_as_on_the_training_format(served):
    _, client, engine = served
    for prompt in PROMPTS:
        want = TOK.decode(training_format_greedy(engine, prompt, 6))
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0)
        assert out.choices[0].text == want
        assert out.usage.prompt_tokens == len(prompt) + 1  # BOS + characters


def test_chat_greedy_answers_as_on_the_training_format(served):
    _, client, engine = served
    for prompt in PROMPTS:
        want = TOK.decode(training_format_greedy(engine, prompt, 6))
        out = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=6,
            temperature=0,
        )  # fmt: skip
        assert out.choices[0].message.role == "assistant"
        assert out.choices[0].message.content == want
        assert out.usage.prompt_tokens == len(prompt) + 1


def test_streamed_text_equals_non_streamed_token_for_token(served):
    _, client, _ = served
    for kw in (
        dict(temperature=0),
        dict(temperature=1.0, seed=5),
        dict(temperature=0, stop=["OO"]),
        dict(temperature=1.0, seed=5, stop=["O:"]),
    ):
        full = client.completions.create(model=NAME, prompt="12+34=", max_tokens=12, **kw)
        chunks = list(client.completions.create(model=NAME, prompt="12+34=", max_tokens=12,
                                                stream=True,
                                                stream_options={"include_usage": True}, **kw))  # fmt: skip
        texts = [c.choices[0].text for c in chunks if c.choices]
        assert "".join(texts) == full.choices[0].text
        finals = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finals[-1] == full.choices[0].finish_reason and not any(finals[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
            full.choices[0].token_ids
        )
        chat_kw = dict(model=NAME, messages=[{"role": "user", "content": "12+34="}],
                       max_tokens=12, **kw)  # fmt: skip
        full_chat = client.chat.completions.create(**chat_kw)
        deltas = [c.choices[0].delta.content or "" for c in
                  client.chat.completions.create(stream=True, **chat_kw) if c.choices]  # fmt: skip
        assert "".join(deltas) == full_chat.choices[0].message.content == full.choices[0].text


def test_stream_framing_as_vllm(served):
    """vLLM test_completion_streaming / test_chat_streaming framing: finish_reason once, on the
    last token's chunk (one chunk per token with logprobs, no extra empty chunk), echo merged
    into the first chunk, continuous_usage_stats, stream_options without stream refused."""
    server, client, _ = served
    kw = dict(model=NAME, prompt="12+34=", max_tokens=6, temperature=0, logprobs=0)
    full = client.completions.create(**kw).choices[0]
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    assert len(chunks) == len(full.token_ids)  # type: ignore[attr-defined]
    assert [c.choices[0].finish_reason for c in chunks] == [None] * 5 + ["length"]
    assert chunks[-1].choices[0].text and "".join(c.choices[0].text for c in chunks) == full.text
    echo = [c for c in client.completions.create(stream=True, echo=True, **kw) if c.choices]
    assert len(echo) == len(chunks) and echo[0].choices[0].text.startswith("12+34=")
    assert "".join(c.choices[0].text for c in echo) == "12+34=" + full.text
    assert sum(len(c.choices[0].logprobs.tokens) for c in echo) == len("12+34=") + 1 + 6
    usage = [c.usage for c in client.completions.create(stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}, **kw)]  # fmt: skip
    assert [u.completion_tokens for u in usage] == [1, 2, 3, 4, 5, 6, 6]  # + the usage chunk
    assert {u.prompt_tokens for u in usage} == {len("12+34=") + 1}
    chat_kw = dict(model=NAME, messages=[{"role": "user", "content": "12+34="}], max_tokens=6,
                   temperature=0, logprobs=True)  # fmt: skip
    chat = [c for c in client.chat.completions.create(stream=True, **chat_kw) if c.choices]
    assert len(chat) == 1 + 6  # the role chunk, then one per token
    assert [c.choices[0].finish_reason for c in chat][-2:] == [None, "length"]
    for body in (
        {"prompt": "1", "stream_options": {"include_usage": True}},
        {
            "messages": [{"role": "user", "content": "1"}],
            "stream_options": {"include_usage": True},
            "stream": False,
        },
    ):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        resp = httpx.post(server.url + path, json=body, timeout=30)
        assert resp.status_code == 400 and "stream_options" in resp.json()["error"]["message"]


def test_chat_parity_echo_specials_and_vllm_validation(served, model):
    """Chat has matched_stop and return_tokens_as_token_ids; a token-id prompt echoes its
    special tokens; vLLM's 400s for stop_token_ids beyond the vocabulary and for prompt +
    max_tokens over the context (naming the field); vLLM's prompt_logprobs."""
    server, client, _ = served
    msgs = [{"role": "user", "content": "12+34="}]
    chat = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True})  # fmt: skip
    ch = chat.choices[0]
    assert [e.token for e in ch.logprobs.content] == [f"token_id:{t}" for t in ch.token_ids]  # type: ignore[attr-defined]
    assert all(a.token.startswith("token_id:") for e in ch.logprobs.content for a in e.top_logprobs)
    stop_tok = ch.token_ids[2]  # type: ignore[attr-defined]
    stopped = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0,
                                             extra_body={"stop_token_ids": [stop_tok]}).choices[0]  # fmt: skip
    assert stopped.finish_reason == "stop" and stopped.matched_stop == stop_tok  # type: ignore[attr-defined]

    ids = [TOK.bos_id, *TOK.encode("12+34=")]
    echo = client.completions.create(model=NAME, prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("<bos>12+34=")

    def error(path: str, body: dict) -> str:
        resp = httpx.post(server.url + path, json=body, timeout=30)
        assert resp.status_code == 400, resp.text
        return resp.json()["error"]["message"]

    assert "stop_token_ids" in error(
        "/v1/completions", {"prompt": "1", "stop_token_ids": [TOK.vocab_size]}
    )
    assert "stop_token_ids" in error(
        "/v1/chat/completions", {"messages": msgs, "stop_token_ids": [10**6]}
    )
    assert error("/v1/completions", {"prompt": ids, "max_tokens": 64 - len(ids) + 1}).startswith(
        "max_tokens"
    )
    assert "max_completion_tokens" in error(
        "/v1/chat/completions", {"messages": msgs, "max_completion_tokens": 64}
    )
    fits = client.completions.create(
        model=NAME, prompt=ids, max_tokens=64 - len(ids), temperature=0
    )
    assert fits.usage.total_tokens <= 64
    long_ids = [TOK.bos_id, *TOK.encode("1+2=" * 12)]  # 49 tokens: the default 32 won't fit
    default = httpx.post(server.url + "/v1/completions", json={"prompt": long_ids,
                         "max_tokens": None, "ignore_eos": True}, timeout=30).json()  # fmt: skip
    assert default["usage"]["total_tokens"] == 64  # capped at the context, not 65 (vLLM)

    # vLLM test_prompt_logprobs_completion: None at 0, then n or n + 1 entries per position
    with torch.no_grad():
        raw = torch.log_softmax(model(torch.tensor([ids])).logits_BTV[0], -1)
    for n in (0, 3):
        out = client.completions.create(model=NAME, prompt=[ids, ids], max_tokens=1,
                                        extra_body={"prompt_logprobs": n})  # fmt: skip
        for choice in out.choices:
            plp = choice.prompt_logprobs  # type: ignore[attr-defined]
            assert plp[0] is None and len(plp) == len(ids)
            for j, entry in enumerate(plp[1:], start=1):
                assert max(n, 1) <= len(entry) <= n + 1 and str(ids[j]) in entry
                assert entry[str(ids[j])]["logprob"] == pytest.approx(
                    float(raw[j - 1, ids[j]]), abs=1e-4
                )
    chat_plp = httpx.post(server.url + "/v1/chat/completions", json={"messages": msgs,
                          "max_tokens": 1, "prompt_logprobs": 2}, timeout=30).json()["prompt_logprobs"]  # fmt: skip
    assert chat_plp[0] is None and all(2 <= len(e) <= 3 for e in chat_plp[1:])


def test_streamed_logprobs_and_tokens_match(served):
    _, client, _ = served
    kw = dict(model=NAME, prompt="7-5=", max_tokens=8, temperature=0.8, seed=11, logprobs=2)
    full = client.completions.create(**kw)
    streamed = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    lps = [x for c in streamed if c.choices[0].logprobs
           for x in c.choices[0].logprobs.token_logprobs]  # fmt: skip
    assert tokens == full.choices[0].logprobs.tokens
    assert lps == pytest.approx(full.choices[0].logprobs.token_logprobs)


def test_completion_logprobs_top_n_and_echo(served, model):
    _, client, _ = served
    out = client.completions.create(model=NAME, prompt="12+34=", max_tokens=3, temperature=1.0,
                                    seed=2, logprobs=3, echo=True)  # fmt: skip
    ch = out.choices[0]
    assert ch.text.startswith("12+34=")
    lp = ch.logprobs
    n_prompt = len("12+34=") + 1
    assert len(lp.tokens) == n_prompt + 3 and lp.token_logprobs[0] is None
    assert "".join(lp.tokens) == ch.text  # BOS shows as "" and text_offset adds up
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # echoed prompt logprobs = the model's own log-softmax at each prompt position
    ids = [TOK.bos_id, *TOK.encode("12+34=")]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits_BTV[0], -1)
    for j in range(1, n_prompt):
        assert lp.token_logprobs[j] == pytest.approx(float(ref[j - 1, ids[j]]), abs=1e-4)
        # raw top-3 plus the prompt token itself when it is not among them (vLLM)
        assert lp.tokens[j] in lp.top_logprobs[j] and 3 <= len(lp.top_logprobs[j]) <= 4
        assert lp.top_logprobs[j][lp.tokens[j]] == pytest.approx(lp.token_logprobs[j])
    for j in range(n_prompt, len(lp.tokens)):  # generated: up to 3 alternatives + the sampled
        assert lp.tokens[j] in lp.top_logprobs[j] and 3 <= len(lp.top_logprobs[j]) <= 4
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user",
                                          "content": "1+1="}], max_tokens=4, temperature=0.7,
                                          seed=1, logprobs=True, top_logprobs=2)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert all(len(e.top_logprobs) <= 2 and e.bytes == list(e.token.encode()) for e in content)


def test_top_logprobs_are_raw_at_temperature_zero_and_logprobs_zero_gives_one(served, model):
    """vLLM test_completion's zero/some logprobs and SGLang's top_logprobs_num at temperature 0:
    the model's raw top-n (not the point mass greedy sampling uses)."""
    server, client, _ = served
    ids = [TOK.bos_id, *TOK.encode("12+34=")]
    tid = {"return_tokens_as_token_ids": True}  # token strings may collide (specials are "")
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0.0,
                                    logprobs=5, extra_body=tid)  # fmt: skip
    lp = out.choices[0].logprobs
    tokens = out.choices[0].token_ids  # type: ignore[attr-defined]
    with torch.no_grad():
        raw = torch.log_softmax(model(torch.tensor([ids + tokens])).logits_BTV[0], -1)
    for i, tops in enumerate(lp.top_logprobs):
        ref = raw[len(ids) - 1 + i].topk(5)
        assert list(tops) == [f"token_id:{t}" for t in ref.indices.tolist()]
        assert list(tops.values()) == pytest.approx(ref.values.tolist(), abs=1e-4)
        assert lp.tokens[i] == f"token_id:{tokens[i]}" == next(iter(tops))  # greedy: the argmax
        assert lp.token_logprobs[i] == pytest.approx(ref.values[0].item(), abs=1e-4)
    zero = client.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0.0,
                                     logprobs=0, echo=True, extra_body=tid)  # fmt: skip
    zl = zero.choices[0].logprobs
    assert zl.top_logprobs[0] is None and len(zl.top_logprobs) == len(ids) + 4
    assert all(list(t) == [tok] for t, tok in zip(zl.top_logprobs[1:], zl.tokens[1:], strict=True))
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 3},
            "return_logprob": True, "top_logprobs_num": 5}  # fmt: skip
    meta = httpx.post(server.url + "/generate", json=body, timeout=60).json()["meta_info"]
    for i, tops in enumerate(meta["output_top_logprobs"]):
        assert [t[1] for t in tops] == raw[len(ids) - 1 + i].topk(5).indices.tolist()
    # greedy: the chosen token's logprob is the model's (SGLang's greedy sampler), not 0.0
    for i, t in enumerate(meta["output_token_logprobs"]):
        assert t[0] == pytest.approx(float(raw[len(ids) - 1 + i, t[1]]), abs=1e-4) and t[0] < 0


def test_errors_have_the_openai_shape(served):
    _, client, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="1+1=", max_tokens=2, temperature=-1)
    assert "temperature" in e.value.message and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="1+1=", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])  # fmt: skip
    ok = client.completions.create(model=NAME, prompt="1+1=", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_sglang_style_generate_client(served, model):
    """The /generate calls SGLang clients (slime, verl, miles) make: batch of texts, input_ids,
    logprobs with text, streaming SSE with cumulative text ending in [DONE]."""
    server, _, engine = served
    url = server.url + "/generate"
    body = {"text": PROMPTS, "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "return_logprob": True, "return_text_in_logprobs": True}  # fmt: skip
    outs = httpx.post(url, json=body, timeout=30).json()
    for prompt, o in zip(PROMPTS, outs, strict=True):
        assert o["output_ids"] == training_format_greedy(engine, prompt, 6)
        assert [x[1] for x in o["meta_info"]["output_token_logprobs"]] == o["output_ids"]
        assert "".join(x[2] for x in o["meta_info"]["output_token_logprobs"]) == o["text"]
    events = []
    with httpx.stream("POST", url, json={**body, "text": PROMPTS[0], "stream": True},
                      timeout=30) as resp:  # fmt: skip
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert (
        chunks[-1]["text"] == outs[0]["text"] and chunks[-1]["output_ids"] == outs[0]["output_ids"]
    )
    assert chunks[-1]["meta_info"]["finish_reason"] == outs[0]["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    for a, b in zip(chunks, chunks[1:], strict=False):  # cumulative, as SGLang by default
        assert b["text"].startswith(a["text"])
