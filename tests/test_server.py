"""The OpenAI-compatible server, exercised with the official openai client over real HTTP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest


def http(method: str, url: str, body: dict | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    path = tiny_checkpoints["a"][0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "solo.cli",
            "serve",
            "--model",
            str(path),
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--lm-head",
            "fp32",
            "--speculative-algorithm",
            "NEXTN",
            "--allow-fallback",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ.copy(),
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if http("GET", f"{base}/health")[0] == 200:
                break
        except OSError:
            time.sleep(0.2)
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read())
    yield base
    proc.terminate()
    proc.wait(10)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


def test_completion_matches_engine(client, tiny_checkpoints):
    from solo.engine.engine import Engine, GenerationParams

    engine = Engine.from_pretrained(tiny_checkpoints["a"][0], lm_head="fp32")
    want = engine.generate("Hello", GenerationParams(max_tokens=12, ignore_eos=True))
    got = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, extra_body={"ignore_eos": True})
    assert got.choices[0].text == want.text and got.usage.completion_tokens == 12
    assert got.choices[0].finish_reason == "length"


def test_streaming_chat_assembles_the_same_text(client):
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=10,
        seed=1,
        temperature=0.7,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs)
    parts = [
        c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs) if c.choices
    ]
    assert "".join(parts) == whole.choices[0].message.content


def test_malformed_requests_get_clear_400s(client, server):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-9", prompt="x")
    status, body = http("POST", f"{server}/v1/chat/completions", {"model": "tiny", "messages": []})
    assert status == 400 and "messages" in json.loads(body)["error"]["message"]
    status, body = http("POST", f"{server}/v1/completions", {"model": "tiny", "prompt": [1, 10**9]})
    assert status == 400 and "vocabulary" in json.loads(body)["error"]["message"]


def test_metrics_expose_acceptance(client, server):
    client.completions.create(model="tiny", prompt="abc", max_tokens=8)
    text = http("GET", f"{server}/metrics")[1]
    assert "solo_spec_accept_length" in text and "solo_spec_verify_rounds_total" in text
    assert "solo_spec_low_acceptance_warnings_total" in text
