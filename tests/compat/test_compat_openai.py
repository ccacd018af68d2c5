"""The OpenAI API with the official `openai` client: the assertions of vLLM's own server tests
(tests/entrypoints/openai: test_completion.py single / batch / parallel sampling / streaming /
stream options / echo / logprobs / prompt logprobs / errors, test_chat.py) against `slipstream
serve`."""

from __future__ import annotations

import httpx
import pytest
from compat_registry import covers
from compat_server import MAX_SEQ_LEN, Served

from slipstream.model.tokenizer import CharTokenizer

openai = pytest.importorskip("openai")
PROMPT = "12+34="


@pytest.fixture(scope="module")
def client(served: Served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@covers("models", "errors")
def test_models_and_error_shape(served, client):
    assert [m.id for m in client.models.list().data] == [served.name]
    assert client.models.retrieve(served.name).id == served.name
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT)
    resp = httpx.post(served.url + "/v1/completions", json={"prompt": PROMPT, "n": 0})
    err = resp.json()["error"]
    assert resp.status_code == 400 and set(err) == {"message", "type", "param", "code"}
    assert err["code"] == 400 and "n" in err["message"]


@covers("completions", "extensions")
def test_single_batch_and_parallel_completions(served, client):
    out = client.completions.create(model=served.name, prompt=PROMPT, max_tokens=5,
                                    temperature=0.0, extra_body={"ignore_eos": True})  # fmt: skip
    choice = out.choices[0]
    # vLLM test_single_completion: 5 tokens make at least 5 characters (one per token here)
    assert len(out.choices) == 1 and len(choice.text) >= 5 and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 5 and out.usage.prompt_tokens == len(PROMPT) + 1
    assert out.usage.total_tokens == out.usage.prompt_tokens + 5
    batch = client.completions.create(model=served.name, prompt=[PROMPT, PROMPT], max_tokens=5,
                                      temperature=0.0, extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.text for c in batch.choices] == [choice.text] * 2
    top1 = client.completions.create(model=served.name, prompt=PROMPT, max_tokens=5, seed=1,
                                     temperature=1.0, extra_body={"top_k": 1, "ignore_eos": True})  # fmt: skip
    assert top1.choices[0].text == choice.text  # top_k = 1 is greedy
    par = client.completions.create(model=served.name, prompt=PROMPT, max_tokens=10, n=3,
                                    temperature=1.0, seed=7, extra_body={"ignore_eos": True})  # fmt: skip
    assert len(par.choices) == 3 and len({c.text for c in par.choices}) == 3


@covers("completions")
def test_stop_top_p_top_k_min_p_take_effect(served, client):
    """The sampling knobs sent over HTTP change what is sampled as each one defines."""
    kw = dict(model=served.name, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True})
    greedy = client.completions.create(temperature=0.0, **kw).choices[0].text
    # stop: the text ends before the first occurrence of the stop string (vLLM: stop_reason)
    cut = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])
    stopped = client.completions.create(temperature=0.0, stop=[greedy[cut]], **kw).choices[0]
    assert stopped.text == greedy[:cut] and stopped.finish_reason == "stop"
    assert stopped.stop_reason == greedy[cut]  # type: ignore[attr-defined]
    hot = {**kw, "extra_body": {"ignore_eos": True}}
    free = {client.completions.create(temperature=1.0, seed=s, **hot).choices[0].text
            for s in range(6)}  # fmt: skip
    assert free != {greedy}  # at temperature 1 the seeds differ from greedy...
    for knob in ({"top_p": 1e-6}, {"extra_body": {"ignore_eos": True, "top_k": 1}},
                 {"extra_body": {"ignore_eos": True, "min_p": 1.0}}):  # fmt: skip
        # ...but a filter that keeps only the most likely token makes every seed greedy
        texts = {client.completions.create(temperature=1.0, seed=s, **{**kw, **knob}).choices[0].text
                 for s in range(6)}  # fmt: skip
        assert texts == {greedy}, knob


@covers("completions_stream")
def test_streaming_and_stream_options(served, client):
    kw = dict(model=served.name, prompt=PROMPT, max_tokens=5, temperature=0.0,
              extra_body={"ignore_eos": True})  # fmt: skip
    single = client.completions.create(**kw).choices[0].text
    chunks, finishes = [], 0
    for chunk in client.completions.create(stream=True, **kw):
        chunks.append(chunk.choices[0].text)
        finishes += chunk.choices[0].finish_reason is not None
    assert finishes == 1 and chunk.choices[0].finish_reason == "length" and chunk.choices[0].text
    assert "".join(chunks) == single
    for opts in (
        {"include_usage": False, "continuous_usage_stats": False},
        {"include_usage": False, "continuous_usage_stats": True},
    ):
        assert all(c.usage is None for c in client.completions.create(stream=True,
                                                                      stream_options=opts, **kw))  # fmt: skip
    stream = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))  # fmt: skip
    assert all(c.usage is None for c in stream[:-1]) and stream[-1].choices == []
    final = stream[-1].usage
    assert final.total_tokens == final.prompt_tokens + final.completion_tokens == len(PROMPT) + 6
    cont = list(client.completions.create(stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}, **kw))  # fmt: skip
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in cont)  # fmt: skip
    for opts in ({"include_usage": True}, {"continuous_usage_stats": True}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(stream=False, stream_options=opts, **kw)
    # vLLM test_parallel_streaming: n choices, each finishing once; test_batch_completions_streaming
    n, texts, finished = 3, {}, {}
    for chunk in client.completions.create(model=served.name, prompt=PROMPT, max_tokens=10, n=n,
                                           temperature=1.0, seed=2, stream=True):  # fmt: skip
        c = chunk.choices[0]
        texts[c.index] = texts.get(c.index, "") + c.text
        finished[c.index] = finished.get(c.index, 0) + (c.finish_reason is not None)
    assert sorted(texts) == [0, 1, 2] and finished == dict.fromkeys(range(n), 1)
    assert len(set(texts.values())) == n
    batch = {}
    for chunk in client.completions.create(model=served.name, prompt=[[1, 5, 6, 7]] * 2,
                                           max_tokens=5, temperature=0.0, stream=True):  # fmt: skip
        assert len(chunk.choices) == 1
        batch[chunk.choices[0].index] = (
            batch.get(chunk.choices[0].index, "") + chunk.choices[0].text
        )
    assert batch[0] == batch[1]


@covers("echo", "completion_logprobs")
def test_echo_and_logprobs(served, client):
    kw = dict(model=served.name, max_tokens=5, temperature=0.0)
    echo = client.completions.create(prompt=PROMPT, echo=True, logprobs=1, **kw).choices[0]
    assert echo.text.startswith(PROMPT) and len(echo.logprobs.tokens) > 5
    assert echo.logprobs.token_logprobs[0] is None and echo.logprobs.top_logprobs[0] is None
    zero = client.completions.create(prompt=PROMPT, logprobs=0, **kw).choices[0].logprobs
    assert zero.token_logprobs is not None and zero.top_logprobs is not None
    assert all(len(t) == 1 for t in zero.top_logprobs)
    some = client.completions.create(prompt=PROMPT, logprobs=5, **kw).choices[0].logprobs
    assert all(len(t) in (5, 6) for t in some.top_logprobs)  # distinct token texts here
    with pytest.raises(openai.BadRequestError):
        client.completions.create(prompt=PROMPT, logprobs=21, **kw)
    ids = [1, 5, 6, 7]  # <bos> + 3 characters
    assert client.completions.create(prompt=ids, echo=True, **kw).choices[0].text.startswith(
        "<bos>")  # fmt: skip
    # temperature 0: the chosen token's logprob is the model's (vLLM raw_logprobs), never 0.0
    for pos, tok in enumerate(some.tokens):
        assert some.token_logprobs[pos] == some.top_logprobs[pos][tok] < 0.0
        assert some.token_logprobs[pos] == max(some.top_logprobs[pos].values())  # greedy: top-1


@covers("token_ids", "prompt_logprobs", "validation")
def test_vllm_extensions_and_validation(served, client):
    kw = dict(model=served.name, prompt=PROMPT, max_tokens=3, temperature=0.0, logprobs=1)
    out = client.completions.create(extra_body={"return_tokens_as_token_ids": True}, **kw)
    assert all(t.startswith("token_id:") for t in out.choices[0].logprobs.tokens)
    # vLLM test_return_tokens_as_ids: echo, logprobs=1; each position's first top-logprob key is
    # its own token; the ids decode to the text
    echo = client.completions.create(model=served.name, prompt="Say 'Hello'", echo=True,
                                     temperature=0, max_tokens=10, logprobs=1,
                                     extra_body={"return_tokens_as_token_ids": True}).choices[0]  # fmt: skip
    token_strs = echo.logprobs.tokens
    assert token_strs[1:] == [next(iter(t)) for t in echo.logprobs.top_logprobs[1:]]
    tokens = [int(t.removeprefix("token_id:")) for t in token_strs]
    assert echo.text == CharTokenizer().decode(tokens, skip_special_tokens=True)  # the served one
    for n in (0, 2):
        plp = client.completions.create(model=served.name, prompt=PROMPT, max_tokens=1,
                                        extra_body={"prompt_logprobs": n}).choices[0].prompt_logprobs  # fmt: skip
        assert plp[0] is None and len(plp) == len(PROMPT) + 1
        assert all(max(n, 1) <= len(p) <= n + 1 for p in plp[1:])
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        client.completions.create(model=served.name, prompt=PROMPT,
                                  extra_body={"stop_token_ids": [served.vocab_size]})  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=served.name, prompt=PROMPT, max_tokens=MAX_SEQ_LEN)


@covers("chat", "chat_logprobs", "token_ids")
def test_chat_single_n_stop_and_logprobs(served, client):
    msgs = [{"role": "user", "content": PROMPT}]
    out = client.chat.completions.create(model=served.name, messages=msgs, max_tokens=6,
                                         temperature=0.0, logprobs=True, top_logprobs=3)  # fmt: skip
    choice = out.choices[0]
    assert choice.message.role == "assistant" and out.usage.completion_tokens <= 6
    assert len(choice.logprobs.content) == out.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 for e in choice.logprobs.content)
    # vLLM passes a message's extra fields and custom roles to the template (agent frameworks
    # send them); an empty model name is the served model
    agent = [{"role": "system", "content": "1", "cache_control": {"type": "ephemeral"}},
             {"role": "user", "content": PROMPT, "reasoning_content": None, "x-trace": "t1"},
             {"role": "critic", "content": "2"}]  # fmt: skip
    for kw in ({"model": served.name, "messages": agent}, {"model": "", "messages": msgs}):
        resp = httpx.post(served.url + "/v1/chat/completions", json={**kw, "max_tokens": 2})
        assert resp.status_code == 200 and resp.json()["model"] == served.name, resp.text
    assert client.completions.create(model="", prompt=PROMPT, max_tokens=2).model == served.name
    two = client.chat.completions.create(model=served.name, messages=msgs, max_tokens=6, n=2,
                                         temperature=1.0, seed=3)  # fmt: skip
    assert len(two.choices) == 2
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=served.name, messages=msgs, logprobs=True,
                                       top_logprobs=21)  # fmt: skip
    stop = choice.token_ids[1]  # type: ignore[attr-defined]
    stopped = client.chat.completions.create(model=served.name, messages=msgs, max_tokens=6,
                                             temperature=0.0,
                                             extra_body={"stop_token_ids": [stop]}).choices[0]  # fmt: skip
    assert stopped.finish_reason == "stop" and stopped.matched_stop == stop  # type: ignore[attr-defined]


@covers("chat_stream")
def test_chat_streaming(served, client):
    kw = dict(model=served.name, messages=[{"role": "user", "content": PROMPT}], max_tokens=5,
              temperature=0.0, extra_body={"ignore_eos": True})  # fmt: skip
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={
        "include_usage": True}, **kw))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == full
    assert [c.choices[0].finish_reason for c in body].count("length") == 1
    assert body[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 5


@covers("prefix_cache")
def test_usage_reports_cached_tokens(served, client):
    prompt = [1] + [5 + i % 30 for i in range(40)]
    client.completions.create(model=served.name, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=served.name, prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    streamed = list(client.completions.create(model=served.name, prompt=prompt, max_tokens=2,
                                              stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == 32


@covers("routed_v1")
def test_routed_experts_on_v1_choices(served, client):
    import base64

    body = {"prompt": [1, 5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "return_routed_experts": True}  # fmt: skip
    choice = httpx.post(served.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    rows, layers, k = choice["routed_experts_layout"]["shape"]
    assert (
        rows == 4 + 3 - 1
        and len(base64.b64decode(choice["routed_experts"])) == rows * layers * k * 4
    )
    gen = httpx.post(served.url + "/generate", json={"input_ids": [1, 5, 6, 7],
                     "return_routed_experts": True, "sampling_params": {"temperature": 0,
                     "max_new_tokens": 3, "ignore_eos": True}}, timeout=30).json()  # fmt: skip
    assert gen["meta_info"]["routed_experts"] == choice["routed_experts"]
    streamed = list(client.completions.create(model=served.name, stream=True,
                    prompt=body["prompt"], max_tokens=3, temperature=0,
                    extra_body={"ignore_eos": True, "return_routed_experts": True}))  # fmt: skip
    assert streamed[-1].choices[0].routed_experts == choice["routed_experts"]  # type: ignore[attr-defined]
    chat = httpx.post(served.url + "/v1/chat/completions", json={"messages": [{"role": "user",
                      "content": "1"}], "max_tokens": 2, "return_routed_experts": True},
                      timeout=30).json()  # fmt: skip
    assert chat["choices"][0]["routed_experts_layout"]["shape"][0] >= 2
