"""`vllm serve` with the plugin on 127.0.0.1: completions, chat, streaming, /metrics."""

import json
import urllib.request

import pytest

from helpers.probes import Server

pytestmark = pytest.mark.e2e


def _post(url, body, stream=False):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.read().decode() if stream else json.loads(resp.read())


@pytest.fixture(scope="module")
def server(tiny_target, tiny_drafter, tmp_path_factory):
    spec = json.dumps({"method": "dflash", "model": str(tiny_drafter), "num_speculative_tokens": 7})
    log = tmp_path_factory.mktemp("server") / "server.log"
    with Server(tiny_target, ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
                              "--gpu-memory-utilization", "0.5", "--served-model-name", "tiny",
                              "--speculative-config", spec], log) as srv:
        yield srv.base


def test_completion(server):
    out = _post(server + "/v1/completions",
                {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0,
                 "ignore_eos": True})
    # The random tiny target may emit tokens that detokenize to "", so count tokens.
    assert out["usage"]["completion_tokens"] == 16
    assert out["choices"][0]["finish_reason"] == "length"


def test_chat_completion(server):
    out = _post(server + "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "Hello!"}],
        "max_tokens": 12, "temperature": 0})
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["completion_tokens"] >= 1


def test_streaming_matches_non_streaming(server):
    body = {"model": "tiny", "prompt": "for i in range(10):", "max_tokens": 20, "temperature": 0,
            "ignore_eos": True}
    whole = _post(server + "/v1/completions", body)["choices"][0]["text"]
    raw = _post(server + "/v1/completions", {**body, "stream": True}, stream=True)
    chunks = [json.loads(line[6:]) for line in raw.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert len(chunks) > 1 and raw.rstrip().endswith("data: [DONE]")
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole


def test_metrics_show_drafts(server):
    _post(server + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 8})
    with urllib.request.urlopen(server + "/metrics", timeout=10) as r:
        text = r.read().decode()
    drafts = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("vllm:spec_decode_num_drafts_total")]
    assert drafts and sum(drafts) > 0
