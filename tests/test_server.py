"""`pagedjax serve` with real clients: the server runs in a subprocess on a free port (the tiny
model), the official `openai` package (sync and async, streaming and not) and raw HTTP talk to it,
and every answer is checked against the offline `LLM` with the same seeds.

Pinned: /v1/models, /health; completions (text, lists, token ids, n, echo, logprobs) and chat
(stream with role chunk, usage, [DONE]) equal to offline runs token for token; 16 concurrent
streaming clients; bad requests answered 400 naming the field (404 for an unknown model) while the
server keeps serving; a client that disconnects mid-stream has its request aborted and its blocks
returned; /metrics parsed by prometheus_client; SIGTERM ends the server cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedjax import LLM, SamplingParams
from server_helpers import eventually, running_server

MODEL = "tiny-random"
ENGINE = dict(max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64, block_size=8, seed=0)


@pytest.fixture(scope="module")
def server():
    with running_server(MODEL, ENGINE) as running:
        yield running


@pytest.fixture(scope="module")
def offline():
    return LLM(MODEL, **ENGINE)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def token_ids(logprobs_tokens) -> list[int]:
    return [int(t.split(":")[1]) for t in logprobs_tokens]


def metrics(url) -> dict:
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            out.setdefault(sample.name, sample.value)
    return out


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server[0] + "/health").status_code == 200


def test_completion_equals_offline(client, offline):
    prompts = ["Hello there", "The cat sat", [5, 6, 7, 8]]
    r = client.completions.create(model=MODEL, prompt=prompts[:2], max_tokens=12, temperature=0, logprobs=1,
                                  extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    ids = client.completions.create(model=MODEL, prompt=prompts[2], max_tokens=12, temperature=0.8, seed=3,
                                    logprobs=0, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    ref = offline.generate([prompts[0], prompts[1], {"prompt_token_ids": prompts[2]}],
                           [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 2
                           + [SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)], use_tqdm=False)
    got = [c for c in sorted(r.choices, key=lambda c: c.index)] + ids.choices
    for c, want in zip(got, ref):
        assert token_ids(c.logprobs.tokens) == want.outputs[0].token_ids
        assert c.text == want.outputs[0].text and c.finish_reason == "length"
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in ref[:2])


def test_streamed_completion_equals_the_whole(client):
    kw = dict(model=MODEL, prompt="stream me", max_tokens=16, temperature=0.7, seed=11, n=2,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    pieces, finish = {0: "", 1: ""}, {}
    usage = None
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert pieces == {c.index: c.text for c in whole.choices}
    assert finish == {0: "length", 1: "length"} and usage.completion_tokens == 32


def test_echo_and_stop(client, offline):
    r = client.completions.create(model=MODEL, prompt="echo this", max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith("echo this")
    free = offline.generate("stop at", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    stop = free[3:5]
    r = client.completions.create(model=MODEL, prompt="stop at", max_tokens=20, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text and free.startswith(r.choices[0].text)


def test_chat_equals_offline_streamed_or_not(client, offline):
    messages = [{"role": "user", "content": "Say something"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0.9, seed=5,
                                       logprobs=True, top_logprobs=2)
    ref = offline.chat(messages, SamplingParams(temperature=0.9, seed=5, max_tokens=10), use_tqdm=False)[0]
    assert r.choices[0].message.content == ref.outputs[0].text and r.choices[0].message.role == "assistant"
    assert len(r.choices[0].logprobs.content) == len(ref.outputs[0].token_ids)
    assert all(len(e.top_logprobs) == 2 for e in r.choices[0].logprobs.content)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0.9,
                                                 seed=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_sixteen_concurrent_streams_equal_offline(server, offline):
    prompts = [f"client {i} says" for i in range(16)]
    params = [dict(max_tokens=10 + i, temperature=0.8, seed=100 + i) for i in range(16)]
    ref = offline.generate(prompts, [SamplingParams(**p, ignore_eos=True) for p in params], use_tqdm=False)
    client = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)

    async def one(prompt, p):
        ids = []
        stream = await client.completions.create(model=MODEL, prompt=prompt, stream=True, logprobs=0,
                                                 extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
                                                 **p)
        async for chunk in stream:
            for c in chunk.choices:
                ids += token_ids(c.logprobs.tokens) if c.logprobs else []
        return ids

    async def all_of():
        return await asyncio.gather(*(one(pr, p) for pr, p in zip(prompts, params)))

    got = asyncio.run(all_of())
    assert got == [o.outputs[0].token_ids for o in ref]


BAD = [
    ({"prompt": "x", "temperature": 5}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 2, "temperature": 0}, "n"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"prompt": [1] * 200}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_completion_requests_name_the_field(server, body, param):
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "BadRequestError" and err["code"] == 400 and err["message"]
    ok = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "fine", "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


def test_bad_chat_requests_and_unknown_model(server):
    url = server[0]
    for body, param in [({"messages": []}, "messages"), ({"messages": "hi"}, "messages"),
                        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
                        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
                         "max_completion_tokens")]:
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(url + "/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    url = server[0]
    idle = metrics(url)
    with httpx.stream("POST", url + "/v1/completions", json={"model": MODEL, "prompt": "long story", "max_tokens": 100,
                                                             "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        busy = metrics(url)
    assert busy["vllm:num_requests_running"] == 1 and busy["pagedjax:kv_free_blocks"] < idle["pagedjax:kv_free_blocks"]
    def back_to_idle():
        m = metrics(url)
        return m["vllm:num_requests_running"] == 0 and m["pagedjax:kv_free_blocks"] == idle["pagedjax:kv_free_blocks"]

    assert eventually(back_to_idle), metrics(url)
    m = metrics(url)
    assert m["vllm:request_success_total"] >= idle.get("vllm:request_success_total", 0)


def test_metrics_parse_with_vllm_names(server, client):
    client.completions.create(model=MODEL, prompt="count me", max_tokens=3)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server[0] + "/metrics").text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
                 "vllm:generation_tokens", "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_success"):
        assert name in families, name
    ttft = {s.name: s.value for s in families["vllm:time_to_first_token_seconds"].samples}
    assert ttft["vllm:time_to_first_token_seconds_count"] >= 1
    assert families["vllm:generation_tokens"].samples[0].value >= 3


def test_online_benchmark_client(server, tmp_path):
    """scripts/bench_online.py against the server: JSONL lengths, Poisson arrivals, goodput, the saved
    vLLM-shaped result."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_online", os.path.join(os.path.dirname(__file__), "..",
                                                                              "scripts", "bench_online.py"))
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_online"] = bench   # its dataclasses look their module up
    spec.loader.exec_module(bench)
    data = tmp_path / "lengths.jsonl"
    data.write_text("\n".join(json.dumps(d) for d in [{"prompt_len": 5, "output_len": 7}, {"prompt": "hi", "output_len": 3}]
                              * 4))
    rc = bench.main(["--base-url", server[0], "--model", MODEL, "--dataset-path", str(data), "--vocab-size", "384",
                     "--request-rate", "40", "--burstiness", "0.5", "--goodput", "ttft:60000", "--save-result",
                     "--result-dir", str(tmp_path), "--result-filename", "r.json"])
    assert rc == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["completed"] == 8 and r["failed"] == 0 and r["total_output_tokens"] == 4 * (7 + 3)
    assert r["request_goodput"] > 0 and r["mean_ttft_ms"] > 0 and r["p99_itl_ms"] is not None



def test_engine_failure_mid_stream_is_reported_in_the_stream():
    """In-process (FastAPI's TestClient): a step that raises ends the streams in flight with an
    error event and [DONE]; the server keeps serving."""
    from fastapi.testclient import TestClient

    from pagedjax.engine import LLMEngine
    from pagedjax.serve.api_server import build_app
    from pagedjax.serve.async_llm import AsyncLLM

    eng = LLMEngine(MODEL, **ENGINE)
    real, calls = eng.step, {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("device lost")
        return real()

    eng.step = step
    with TestClient(build_app(AsyncLLM(eng), MODEL)) as client:
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 20, "stream": True,
                                                 "ignore_eos": True})
        lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert "device lost" in error["message"] and error["code"] == 500
        ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3

def test_sigterm_ends_the_server_cleanly(server):
    url, proc = server
    with httpx.stream("POST", url + "/v1/completions", json={"model": MODEL, "prompt": "never finished",
                                                             "max_tokens": 120, "stream": True,
                                                             "ignore_eos": True}) as r:
        lines = r.iter_lines()
        next(lines)
        proc.send_signal(signal.SIGTERM)
        rest = list(lines)   # the stream ends (the request is aborted), it does not hang
    # uvicorn shuts down gracefully, then ends the process with the signal it caught
    assert proc.wait(30) in (0, -signal.SIGTERM)
    data = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    assert len(data) < 120
    assert "engine loop stopped" in proc.stdout.read()   # the lifespan's shutdown ran

