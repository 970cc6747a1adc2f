"""The API surface of `solo serve` on the bundled model (NEXTN speculation on): the official openai
client exercising every implemented field (sync and async, streamed and not), a 400 naming each
refused field, a fuzz list of malformed requests (each a 4xx with an OpenAI error object), the
Prometheus metrics, API keys and request timeouts. The server is the one `solo serve` runs
(solo.serving.server.make_server), on a thread of the test process."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import ThreadServer, raw_http

from solo.assets import bundled_model
from solo.engine.engine import Engine
from solo.serving.guard import Limits
from solo.serving.server import ServeOptions
from solo.speculative.nextn import SpeculativeConfig

MODEL = "ling-test"
QUESTION = "Question: Tom has 3 bags of 4 apples. How many apples does he have?\nAnswer:"
TIMEOUT = httpx.Timeout(60.0)


@pytest.fixture(scope="module")
def server():
    engine = Engine.from_pretrained(bundled_model(), speculative=SpeculativeConfig())
    options = ServeOptions(
        model_name=MODEL,
        default_max_tokens=64,
        limits=Limits(max_body_bytes=1024 * 1024, body_timeout_s=1.0, max_header_bytes=8 * 1024),
    )
    srv = ThreadServer(engine, options)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def aclient(server):
    return openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=60)


def vocab_id(client, text: str) -> int:
    ids = httpx.post(str(client.base_url.join("/tokenize")), json={"prompt": text}, timeout=TIMEOUT).json()["tokens"]
    assert len(ids) == 1, ids
    return ids[0]


# --------------------------------------------------------------------------- completions
def test_completions_fields(client):
    base = dict(model=MODEL, prompt=QUESTION, max_tokens=16, extra_body={"ignore_eos": True})
    greedy = client.completions.create(**base)
    assert greedy.usage.completion_tokens == 16 and greedy.choices[0].finish_reason == "length"
    # stop: the text ends before it, finish "stop"
    cut = greedy.choices[0].text[4:7]
    stopped = client.completions.create(**{**base, "stop": [cut, "zzz"]})
    assert cut not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    # logprobs: the chosen token and N alternatives; greedy picks the most likely
    lp = client.completions.create(**{**base, "logprobs": 3}).choices[0]
    assert lp.text == greedy.choices[0].text
    assert len(lp.logprobs.tokens) == 16 and all(len(t) == 3 for t in lp.logprobs.top_logprobs)
    for token_lp, top in zip(lp.logprobs.token_logprobs, lp.logprobs.top_logprobs, strict=True):
        assert token_lp <= 0 and token_lp == max(top.values())
    # logit_bias: +100 makes one token certain, -100 forbids the greedy first token
    forced = vocab_id(client, "7")
    assert client.completions.create(**{**base, "logit_bias": {str(forced): 100}}).choices[0].text == "7" * 16
    first = lp.logprobs.tokens[0]
    banned = client.completions.create(**{**base, "logprobs": 0, "logit_bias": {str(vocab_id(client, first)): -100}})
    assert banned.choices[0].logprobs.tokens[0] != first
    # penalties lower the log-probability of tokens already generated (this model is too sure of
    # itself for them to change its greedy text here; tests/test_serving_engine.py shows they do)
    penalized = client.completions.create(**{**base, "logprobs": 0, "presence_penalty": 2.0, "frequency_penalty": 2.0})
    assert penalized.choices[0].logprobs.tokens == lp.logprobs.tokens
    pairs = zip(
        lp.logprobs.tokens, lp.logprobs.token_logprobs, penalized.choices[0].logprobs.token_logprobs, strict=True
    )
    seen, lowered = set(), 0
    for token, x, y in pairs:
        lowered += token in seen and y < x - 1e-3
        seen.add(token)
    assert lowered > 0
    # sampling: n choices, seeded (the same request twice gives the same choices), top_p, top_k, user
    sampled = dict(
        base, temperature=1.0, top_p=0.9, n=3, seed=5, user="u1", extra_body={"top_k": 50, "ignore_eos": True}
    )
    a, b = client.completions.create(**sampled), client.completions.create(**sampled)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1 and a.usage.completion_tokens == 48
    assert client.completions.create(**{**base, "n": 2, "best_of": 2}).usage.completion_tokens == 32
    # a list of prompts (text and token ids), served one after another
    ids = httpx.post(str(client.base_url.join("/tokenize")), json={"prompt": QUESTION}, timeout=TIMEOUT).json()[
        "tokens"
    ]
    many = client.completions.create(model=MODEL, prompt=[QUESTION, "Question: 1+1?\nAnswer:"], max_tokens=4)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == greedy.choices[0].text[: len(many.choices[0].text)]
    by_ids = client.completions.create(model=MODEL, prompt=[ids, ids[:5]], max_tokens=4)
    assert by_ids.choices[0].text == many.choices[0].text
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=4).choices[0].text == many.choices[0].text


def test_echo_scores_the_prompt_as_lm_eval_asks(client):
    ids = httpx.post(str(client.base_url.join("/tokenize")), json={"prompt": QUESTION}, timeout=TIMEOUT).json()[
        "tokens"
    ]
    scored = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    c = scored.choices[0]
    assert c.text == QUESTION and scored.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.token_logprobs) == len(ids)
    assert all(x <= 0 for x in c.logprobs.token_logprobs[1:])
    # lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1 -> prompt entries then one generated
    lm = client.completions.create(model=MODEL, prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0)
    entries = lm.choices[0].logprobs.token_logprobs
    assert len(entries) == len(ids) + 1 and entries[: len(ids)] == pytest.approx(c.logprobs.token_logprobs[:], abs=0)
    echo_only = client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=3, echo=True)
    assert echo_only.choices[0].text.startswith(QUESTION) and echo_only.choices[0].logprobs is None


def test_streamed_completions_carry_logprobs_and_usage(client):
    whole = client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=12, logprobs=2)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=QUESTION, max_tokens=12, logprobs=2, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert text == whole.choices[0].text and tokens == whole.choices[0].logprobs.tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-2].choices[0].finish_reason == "length"
    plain = list(client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=3, stream=True))
    assert all(c.usage is None for c in plain)  # usage only when asked for (stream_options)


# --------------------------------------------------------------------------- chat
def test_chat_fields(client):
    messages = [
        {"role": "system", "content": "You solve grade-school math."},
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Tom has 3 bags "}, {"type": "text", "text": "of 4."}]},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "12", "tool_call_id": "call_1"},
        {"role": "user", "content": "How many apples?"},
    ]
    base = dict(model=MODEL, messages=messages, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**base, max_completion_tokens=5, logprobs=True, top_logprobs=2)
    assert r.usage.completion_tokens == 5 and r.choices[0].message.role == "assistant"
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(
        len(e.top_logprobs) == 2 and e.logprob == e.top_logprobs[0].logprob for e in content
    )
    assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in content) == r.choices[0].message.content
    assert (
        client.chat.completions.create(**base, max_tokens=5).choices[0].message.content == r.choices[0].message.content
    )
    n = client.chat.completions.create(
        **base,
        max_tokens=6,
        n=2,
        seed=1,
        temperature=0.9,
        top_p=0.95,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"5": -50},
        response_format={"type": "text"},
        tool_choice="none",
        user="u2",
        stop=["\n\n"],
        modalities=["text"],
        store=False,
        service_tier="auto",
    )
    assert [c.index for c in n.choices] == [0, 1] and n.usage.completion_tokens <= 12


def test_streamed_chat_with_logprobs_matches_whole(client):
    kwargs = dict(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, logprobs=True, top_logprobs=1
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    entries = [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert text == whole.choices[0].message.content
    assert entries == [e.token for e in whole.choices[0].logprobs.content]
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_async_client(aclient):
    async def main():
        r = await aclient.completions.create(model=MODEL, prompt=QUESTION, max_tokens=6, logprobs=1)
        parts = []
        async for c in await aclient.completions.create(model=MODEL, prompt=QUESTION, max_tokens=6, stream=True):
            parts += [ch.text for ch in c.choices]
        chat = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2, seed=3, temperature=1.0
        )
        deltas = []
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
        )
        async for c in stream:
            deltas += [ch.delta.content or "" for ch in c.choices]
        return r, "".join(parts), chat, "".join(deltas)

    r, streamed, chat, deltas = asyncio.run(asyncio.wait_for(main(), 120))
    assert streamed == r.choices[0].text and len(chat.choices) == 2 and deltas


REFUSED_COMPLETION = {
    "suffix": {"suffix": "x"},
    "best_of": {"best_of": 3},
}
REFUSED_CHAT = {
    "response_format": {"response_format": {"type": "json_object"}},
    "tools": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    "tool_choice": {"tool_choice": "required"},
    "parallel_tool_calls": {"parallel_tool_calls": False},
    "functions": {"functions": [{"name": "f", "parameters": {}}]},
    "function_call": {"function_call": "auto"},
    "audio": {"audio": {"voice": "alloy", "format": "wav"}},
    "modalities": {"modalities": ["text", "audio"]},
    "prediction": {"prediction": {"type": "content", "content": "x"}},
    "reasoning_effort": {"reasoning_effort": "low"},
    "web_search_options": {"web_search_options": {}},
    "store": {"store": True},
    "metadata": {"metadata": {"k": "v"}},
    "service_tier": {"service_tier": "flex"},
    "verbosity": {"verbosity": "low"},
    "prompt_cache_key": {"prompt_cache_key": "k"},
}


def test_refused_fields_get_a_400_naming_them(client):
    for field, kwargs in REFUSED_COMPLETION.items():
        with pytest.raises(openai.BadRequestError, match=field) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, **kwargs)
        assert e.value.body["param"] == field
    for field, kwargs in REFUSED_CHAT.items():
        with pytest.raises(openai.BadRequestError, match=field):
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, **kwargs
            )
    bad_messages = {
        "name": [{"role": "user", "content": "x", "name": "bob"}],
        "type": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
        "tool_calls": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}],
        "content": [{"role": "user", "content": None}],
    }
    for field, messages in bad_messages.items():
        with pytest.raises(openai.BadRequestError, match=field):
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream_options={"include_usage": True})


# --------------------------------------------------------------------------- fuzz
def _fuzz_cases() -> list[tuple[str, str, bytes | dict]]:
    c, ch = "/v1/completions", "/v1/chat/completions"
    ok = {"prompt": "x", "max_tokens": 2}
    msg = [{"role": "user", "content": "x"}]
    cases: list[tuple[str, str, bytes | dict]] = [
        ("not json", c, b"{"),
        ("json array", c, b"[]"),
        ("json string", c, b'"x"'),
        ("json null", c, b"null"),
        ("empty body", c, b""),
        ("invalid utf-8", c, b'{"prompt": "\xff\xfe"}'),
        ("lone surrogate", c, b'{"prompt": "\\ud800"}'),
        ("lone surrogate in a key", c, b'{"prompt": "x", "\\udfff": 1}'),
        ("lone surrogate in chat", ch, b'{"messages": [{"role": "user", "content": "a\\udc00"}]}'),
        ("huge integer", c, b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"),
        ("deep nesting", c, b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}"),
        ("no prompt", c, {"max_tokens": 2}),
        ("prompt int", c, {"prompt": 5}),
        ("prompt bool", c, {"prompt": True}),
        ("prompt empty list", c, {"prompt": []}),
        ("prompt empty string", c, {"prompt": ""}),
        ("prompt empty id list", c, {"prompt": [[]]}),
        ("prompt mixed list", c, {"prompt": [1, "a"]}),
        ("prompt negative id", c, {"prompt": [-1]}),
        ("prompt id past vocab", c, {"prompt": [10**9]}),
        ("too many prompts", c, {"prompt": ["x"] * 65}),
        ("prompt past context", c, {"prompt": "7 " * 50000, "max_tokens": 2}),
        ("max_tokens bool", c, {**ok, "max_tokens": True}),
        ("max_tokens negative", c, {**ok, "max_tokens": -1}),
        ("max_tokens float", c, {**ok, "max_tokens": 1.5}),
        ("max_tokens string", c, {**ok, "max_tokens": "10"}),
        ("max_tokens past context", c, {**ok, "max_tokens": 10**6}),
        ("max_tokens 0 without echo", c, {**ok, "max_tokens": 0}),
        ("temperature string", c, {**ok, "temperature": "hot"}),
        ("temperature Infinity", c, b'{"prompt": "x", "temperature": Infinity}'),
        ("temperature NaN", c, b'{"prompt": "x", "temperature": NaN}'),
        ("temperature negative", c, {**ok, "temperature": -1}),
        ("temperature 3", c, {**ok, "temperature": 3}),
        ("temperature bool", c, {**ok, "temperature": False}),
        ("top_p 0", c, {**ok, "top_p": 0}),
        ("top_p 1.5", c, {**ok, "top_p": 1.5}),
        ("top_k negative", c, {**ok, "top_k": -1}),
        ("n -5", c, {**ok, "n": -5}),
        ("n 0", c, {**ok, "n": 0}),
        ("n 1000", c, {**ok, "n": 1000}),
        ("n bool", c, {**ok, "n": True}),
        ("prompts x n", c, {"prompt": ["a"] * 10, "n": 10}),
        ("seed 2**64", c, {**ok, "seed": 2**64}),
        ("seed below -2**63", c, {**ok, "seed": -(2**63) - 1}),
        ("seed float", c, {**ok, "seed": 1.0}),
        ("10000 stop strings", c, {**ok, "stop": ["s"] * 10000}),
        ("empty stop string", c, {**ok, "stop": [""]}),
        ("stop int", c, {**ok, "stop": 5}),
        ("stop too long", c, {**ok, "stop": ["x" * 1000]}),
        ("stream yes", c, {**ok, "stream": "yes"}),
        ("stream 1", c, {**ok, "stream": 1}),
        ("stream_options without stream", c, {**ok, "stream_options": {"include_usage": True}}),
        ("stream_options bad type", c, {**ok, "stream": True, "stream_options": {"include_usage": "yes"}}),
        ("stream_options unknown", c, {**ok, "stream": True, "stream_options": {"foo": 1}}),
        ("logprobs abc", c, {**ok, "logprobs": "abc"}),
        ("logprobs 21", c, {**ok, "logprobs": 21}),
        ("logprobs -1", c, {**ok, "logprobs": -1}),
        ("echo string", c, {**ok, "echo": "true"}),
        ("presence_penalty 3", c, {**ok, "presence_penalty": 3}),
        ("frequency_penalty string", c, {**ok, "frequency_penalty": "a"}),
        ("logit_bias key", c, {**ok, "logit_bias": {"abc": 1}}),
        ("logit_bias value", c, {**ok, "logit_bias": {"5": 1000}}),
        ("logit_bias id past vocab", c, {**ok, "logit_bias": {"999999": 1}}),
        ("logit_bias list", c, {**ok, "logit_bias": [1, 2]}),
        ("unknown field", c, {**ok, "foo": 1}),
        ("suffix", c, {**ok, "suffix": "x"}),
        ("best_of", c, {**ok, "best_of": 3}),
        ("model unknown", c, {**ok, "model": "gpt-9"}),
        ("model int", c, {**ok, "model": 5}),
        ("chat no messages", ch, {"max_tokens": 2}),
        ("chat empty messages", ch, {"messages": []}),
        ("chat messages string", ch, {"messages": "hi"}),
        ("chat role", ch, {"messages": [{"role": "wizard", "content": "x"}]}),
        ("chat content int", ch, {"messages": [{"role": "user", "content": 5}]}),
        ("chat image part", ch, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
        ("chat part without text", ch, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
        ("chat user content null", ch, {"messages": [{"role": "user", "content": None}]}),
        ("chat message unknown field", ch, {"messages": [{"role": "user", "content": "x", "audio": {}}]}),
        ("chat name", ch, {"messages": [{"role": "user", "content": "x", "name": "bob"}]}),
        ("chat tools", ch, {"messages": msg, "tools": [{"type": "function"}]}),
        ("chat response_format", ch, {"messages": msg, "response_format": {"type": "json_object"}}),
        ("chat logprobs string", ch, {"messages": msg, "logprobs": "yes"}),
        ("chat top_logprobs alone", ch, {"messages": msg, "top_logprobs": 2}),
        ("chat top_logprobs 50", ch, {"messages": msg, "logprobs": True, "top_logprobs": 50}),
        ("chat max_completion_tokens 0", ch, {"messages": msg, "max_completion_tokens": 0}),
        ("chat max_tokens conflict", ch, {"messages": msg, "max_tokens": 3, "max_completion_tokens": 4}),
        ("chat too many messages", ch, {"messages": msg * 2000}),
        ("tokenize neither", "/tokenize", {}),
        ("detokenize bad id", "/detokenize", {"tokens": [-1]}),
    ]
    return cases


def test_fuzz_every_malformed_request_gets_a_4xx_error_object(client, server):
    before = client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=10).choices[0].text
    cases = _fuzz_cases()
    with httpx.Client(base_url=server.base, timeout=TIMEOUT) as http:
        results = []
        for name, path, body in cases:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
            results.append((name, r))
        results.append(("GET unknown route", http.get("/v1/nothing")))
        results.append(("GET on a POST route", http.get("/v1/completions")))
        results.append(("DELETE /v1/models", http.delete("/v1/models")))
        results.append(("unknown model id", http.get("/v1/models/gpt-9")))
        results.append(("header too large", http.get("/v1/models", headers={"X-Big": "a" * 20000})))
        results.append(("body too large", http.post("/v1/completions", content=b" " * (2 * 1024 * 1024))))
    port = int(server.base.rsplit(":", 1)[1])
    short = raw_http(port, b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt"')
    for name, r in results:
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:300])
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and "type" in error, name
    assert short.startswith(b"HTTP/1.1 408") and b'"error"' in short
    assert len(results) >= 60
    # still healthy and still right
    assert httpx.get(f"{server.base}/health", timeout=TIMEOUT).json()["status"] == "ok"
    assert client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=10).choices[0].text == before


def test_models_and_tokenizer_endpoints(client, server):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    info = httpx.get(f"{server.base}/tokenizer_info", timeout=TIMEOUT).json()
    assert info["eos_token"] == "<|role_end|>"
    ids = httpx.post(f"{server.base}/tokenize", json={"prompt": "Hello world"}, timeout=TIMEOUT).json()["tokens"]
    text = httpx.post(f"{server.base}/detokenize", json={"tokens": ids}, timeout=TIMEOUT).json()["prompt"]
    assert text == "Hello world"


def test_metrics_parse_and_move(client, server):
    def read() -> dict[str, float]:
        text = httpx.get(f"{server.base}/metrics", timeout=TIMEOUT).text
        out = {}
        for family in text_string_to_metric_families(text):
            assert family.documentation, family.name  # HELP on every metric
            for s in family.samples:
                key = s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else "")
                out[key] = s.value
        return out

    before = read()
    client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=8, extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=QUESTION, temperature=-1)
    after = read()

    def grew(key: str, by: float | None = None) -> bool:
        delta = after.get(key, 0) - before.get(key, 0)
        return delta == by if by is not None else delta > 0

    ok = 'solo_http_responses_total{"endpoint": "/v1/completions", "status": "200"}'
    bad = 'solo_http_responses_total{"endpoint": "/v1/completions", "status": "400"}'
    assert grew(ok, 1) and grew(bad, 1)
    assert grew('solo_requests_total{"finish_reason": "length"}', 1)
    assert grew("solo_generated_tokens_total", 8) and grew("solo_prompt_tokens_total")
    for histogram in (
        "solo_time_to_first_token_seconds",
        "solo_e2e_request_latency_seconds",
        "solo_queue_wait_seconds",
    ):
        assert grew(f"{histogram}_count", 1), histogram
    assert grew("solo_time_per_output_token_seconds_count", 1)
    assert grew("solo_spec_verify_rounds_total") and grew("solo_spec_draft_tokens_total")
    assert 'solo_spec_accepted_per_position_total{"position": "0"}' in after
    assert after["solo_queue_length"] == 0 and "solo_spec_low_acceptance_warnings_total" in after
    assert math.isfinite(after["solo_spec_accept_length"])


# --------------------------------------------------------------------------- keys and timeouts (tiny model)
@pytest.fixture(scope="module")
def tiny_engine(tiny_checkpoints):
    return Engine.from_pretrained(tiny_checkpoints["a"][0], lm_head="fp32")


def test_api_key(tiny_engine):
    srv = ThreadServer(tiny_engine, ServeOptions(model_name="tiny", api_key="s3cret"))
    try:
        anonymous = openai.OpenAI(base_url=f"{srv.base}/v1", api_key="wrong", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError, match="API key") as e:
            anonymous.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert e.value.body["code"] == "invalid_api_key"
        r = httpx.get(f"{srv.base}/v1/models", timeout=TIMEOUT)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{srv.base}/health", timeout=TIMEOUT).status_code == 200  # open to health checks
        keyed = openai.OpenAI(base_url=f"{srv.base}/v1", api_key="s3cret", max_retries=0, timeout=30)
        assert keyed.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens >= 1
    finally:
        srv.close()


def test_request_timeout(tiny_engine):
    srv = ThreadServer(tiny_engine, ServeOptions(model_name="tiny", request_timeout_s=0.5))
    try:
        body = {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 3500, "ignore_eos": True}
        start = time.monotonic()
        r = httpx.post(f"{srv.base}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 504 and "request-timeout" in r.json()["error"]["message"]
        assert time.monotonic() - start < 5
        with httpx.stream("POST", f"{srv.base}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert "request-timeout" in lines[-2] and lines[-1] == "data: [DONE]"
        ok = httpx.post(f"{srv.base}/v1/completions", json={**body, "max_tokens": 3}, timeout=TIMEOUT)
        assert ok.status_code == 200  # the engine was freed
    finally:
        srv.close()


def test_slow_headers_and_slow_bodies_are_cut_off(server):
    """A client that trickles its headers, or sends less body than it announced, loses the
    connection after the body timeout (1 s here), and the server serves the next client."""
    port = int(server.base.rsplit(":", 1)[1])
    start = time.monotonic()
    got = raw_http(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", timeout_s=15)  # headers never end
    assert got == b"" and time.monotonic() - start < 5  # closed, not held
    start = time.monotonic()
    got = raw_http(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{}", timeout_s=15)
    assert got.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 5
    assert httpx.get(f"{server.base}/health", timeout=TIMEOUT).status_code == 200
