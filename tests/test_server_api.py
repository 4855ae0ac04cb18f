"""`pagedjax serve`'s OpenAI API shapes, beyond what tests/test_server.py checks: a server in a
subprocess on the tiny model (the same small engine), and the official `openai` client parsing its
answers (Completion, ChatCompletion, ChatCompletionChunk).

Pinned: completions with a list of prompts and n > 1, streamed or not (choice index = prompt index *
n + sample index, one finish_reason per choice, each prompt's tokens counted once in usage), a list
of token-id lists, echo with logprobs (the prompt's tokens first, the first with no logprob; the
streamed offsets running on across chunks), stop_token_ids (stop_reason is the id), min_tokens
holding EOS back, max_tokens omitted (OpenAI's 16), seeds, logprobs=0; chat with n > 1 streamed
(one role chunk and one finish per choice), content parts, the chat template's options,
max_completion_tokens, logprobs without top_logprobs, include_usage false; 400s for a prompt over
max_model_len, tools, response_format and a body that is no object; FastAPI's own 404/405; and the
server serving a good request after every error."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pagedjax.testing import ByteTokenizer
from server_helpers import eventually, running_server

MODEL = "tiny-random"
ENGINE = dict(max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64, block_size=8, seed=0)
TOK = ByteTokenizer()
EOS = TOK.eos_token_id


@pytest.fixture(scope="module")
def server():
    with running_server(MODEL, ENGINE) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def ids_of(tokens) -> list[int]:
    return [int(t.split(":")[1]) for t in tokens]


def n_tokens(text: str) -> int:
    return len(TOK.encode(text))


def extra(choice, name):
    """A field the openai types do not declare (vLLM's stop_reason), kept as an extra."""
    return (choice.model_extra or {}).get(name)


def still_serving(url: str) -> None:
    ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "fine", "max_tokens": 2})
    assert ok.status_code == 200 and Completion.model_validate(ok.json()).choices[0].finish_reason


def sse(url: str, route: str, body: dict) -> list:
    """The data lines of a streamed answer, JSON-decoded, and the final [DONE]."""
    with httpx.stream("POST", url + route, json={"model": MODEL, "stream": True, **body}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" and "[DONE]" not in lines[:-1]
    return [json.loads(x) for x in lines[:-1]]


# -- completions ----------------------------------------------------------------------------------
PROMPTS = ["ab", "cdef"]
LIST_N = dict(model=MODEL, prompt=PROMPTS, n=2, max_tokens=5, temperature=0.9, seed=7, echo=True,
              extra_body={"ignore_eos": True})


def test_prompt_list_with_n_indexes_choices_by_prompt_then_sample(client):
    r = client.completions.create(**LIST_N)
    assert isinstance(r, Completion) and r.object == "text_completion"
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:   # echo says which prompt a choice belongs to
        assert c.text.startswith(PROMPTS[c.index // 2]) and c.finish_reason == "length"
    assert r.usage.prompt_tokens == sum(n_tokens(p) for p in PROMPTS)   # each prompt once, not n times
    assert r.usage.completion_tokens == 4 * 5 and r.usage.total_tokens == r.usage.prompt_tokens + 20


def test_prompt_list_with_n_streamed(client):
    whole = {c.index: c.text for c in client.completions.create(**LIST_N).choices}
    texts, finishes, usage = {}, {}, []
    for chunk in client.completions.create(**LIST_N, stream=True, stream_options={"include_usage": True}):
        assert chunk.object == "text_completion"
        if chunk.usage is not None:
            assert chunk.choices == []
            usage.append(chunk.usage)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finishes.setdefault(c.index, []).append(c.finish_reason)
    assert texts == whole   # same seed, same samples; the prompt leads each choice's first chunk
    assert finishes == {i: ["length"] for i in range(4)}
    assert len(usage) == 1 and usage[0].prompt_tokens == sum(n_tokens(p) for p in PROMPTS)
    assert usage[0].completion_tokens == 20


def test_prompt_as_token_id_lists(client):
    prompts = [[10, 11, 12], [20, 21]]
    kw = dict(model=MODEL, max_tokens=4, temperature=0, logprobs=0,
              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    r = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.prompt_tokens == 5
    for p, c in zip(prompts, r.choices):
        alone = client.completions.create(prompt=p, **kw).choices[0]
        assert ids_of(c.logprobs.tokens) == ids_of(alone.logprobs.tokens) and c.text == alone.text


ECHO = dict(model=MODEL, prompt="hello", max_tokens=4, temperature=0, echo=True, logprobs=1,
            extra_body={"ignore_eos": True})


def test_echo_with_logprobs_leads_with_the_prompt(client):
    c = client.completions.create(**ECHO).choices[0]
    lp = c.logprobs
    assert c.text.startswith("hello") and len(lp.tokens) == 5 + 4
    assert lp.tokens[:5] == list("hello") and "".join(lp.tokens) == c.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None   # nothing predicts the first token
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert all(isinstance(d, dict) and 1 <= len(d) <= 2 for d in lp.top_logprobs[1:])
    assert lp.text_offset == list(range(9))   # one character per byte token


def test_echo_with_logprobs_streamed_equals_the_whole(client):
    whole = client.completions.create(**ECHO).choices[0].logprobs
    tokens, lps, offsets, text = [], [], [], ""
    for chunk in client.completions.create(**ECHO, stream=True):
        for c in chunk.choices:
            text += c.text
            tokens += c.logprobs.tokens
            lps += c.logprobs.token_logprobs
            offsets += c.logprobs.text_offset
    assert text.startswith("hello") and "".join(tokens) == text
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert lps[0] is None and lps[1:] == pytest.approx(whole.token_logprobs[1:])


def test_stop_token_ids_stop_with_the_id_as_stop_reason(client):
    # seeded sampling (the random model's greedy text repeats one token): the same tokens up to the stop
    kw = dict(model=MODEL, prompt="stop here", max_tokens=12, temperature=1.0, seed=5, logprobs=0)
    free = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    ids = ids_of(free.choices[0].logprobs.tokens)
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and ids[i] != EOS)
    r = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                                                    "stop_token_ids": [ids[k]]})
    c = r.choices[0]
    assert c.finish_reason == "stop" and extra(c, "stop_reason") == ids[k]
    assert ids_of(c.logprobs.tokens) == ids[:k + 1] and r.usage.completion_tokens == k + 1


def test_min_tokens_holds_eos_back(client):
    # EOS is made the likeliest token everywhere: without min_tokens it ends the completion at once
    kw = dict(model=MODEL, prompt="x", max_tokens=8, temperature=0, logit_bias={str(EOS): 100})
    r = client.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    assert extra(r.choices[0], "stop_reason") is None   # EOS, not a stop string or token id
    r = client.completions.create(**kw, extra_body={"min_tokens": 3, "ignore_eos": False})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 4   # 3 tokens, then EOS


def test_max_tokens_omitted_is_openai_default_of_16(client, server):
    r = client.completions.create(model=MODEL, prompt="how long", temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    # null, as in vLLM: whatever max_model_len leaves
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "how long", "max_tokens": None,
                                                     "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.json()["usage"]["completion_tokens"] == ENGINE["max_model_len"] - n_tokens("how long")


def test_seed_reproduces_across_calls(client):
    kw = dict(model=MODEL, prompt="roll the dice", max_tokens=8, temperature=1.0, n=2,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw, seed=1234)
    b = client.completions.create(**kw, seed=1234)
    other = client.completions.create(**kw, seed=4321)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.text for c in a.choices] != [c.text for c in other.choices]


def test_logprobs_zero_gives_the_sampled_token_only(client):
    r = client.completions.create(model=MODEL, prompt="zero", max_tokens=5, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top == {tok: pytest.approx(x)}   # vLLM's: the top 0 and the sampled token


# -- chat -----------------------------------------------------------------------------------------
HI = [{"role": "user", "content": "Hi"}]


def test_chat_n_streamed_one_role_and_one_finish_per_choice(client):
    kw = dict(model=MODEL, messages=HI, n=2, max_tokens=6, temperature=0.9, seed=3, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    assert isinstance(whole, ChatCompletion) and [c.index for c in whole.choices] == [0, 1]
    roles, finishes, texts = {}, {}, {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        assert isinstance(chunk, ChatCompletionChunk) and chunk.object == "chat.completion.chunk"
        assert chunk.usage is None
        for c in chunk.choices:
            if c.delta.role is not None:
                assert c.index not in texts   # the role comes first
                roles[c.index] = roles.get(c.index, 0) + 1
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                finishes.setdefault(c.index, []).append(c.finish_reason)
    assert roles == {0: 1, 1: 1} and finishes == {0: ["length"], 1: ["length"]}
    assert texts == {c.index: c.message.content for c in whole.choices}


def chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0, **kw)


def test_chat_content_parts_are_joined(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    r = chat(client, parts)
    same = chat(client, [{"role": "user", "content": "Hi\nthere"}])
    assert r.choices[0].message.content == same.choices[0].message.content
    assert r.usage.prompt_tokens == n_tokens("<user>Hi\nthere\n<assistant>")


def test_chat_template_options(client, server):
    assert chat(client, HI).usage.prompt_tokens == n_tokens("<user>Hi\n<assistant>")
    r = chat(client, HI, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == n_tokens("<user>Hi\n<assistant>")
    r = chat(client, HI, extra_body={"add_generation_prompt": False})
    assert r.usage.prompt_tokens == n_tokens("<user>Hi\n")
    partial = HI + [{"role": "assistant", "content": "Sure"}]
    r = chat(client, partial, extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert r.usage.prompt_tokens == n_tokens("<user>Hi\n<assistant>Sure\n")   # the byte tokenizer's template
    with pytest.raises(openai.BadRequestError):   # continuing a message and starting a new one
        chat(client, partial, extra_body={"continue_final_message": True})
    still_serving(server)


def test_max_completion_tokens_wins_over_max_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=9, max_completion_tokens=2,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


def test_chat_logprobs_without_top_logprobs(client):
    r = chat(client, HI, logprobs=True, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and e.top_logprobs == [] and e.bytes == list(e.token.encode())
    assert chat(client, HI).choices[0].logprobs is None
    assert chat(client, HI, top_logprobs=0).choices[0].logprobs is None   # asks for nothing: no error (vLLM's)


def test_chat_include_usage_false_sends_no_usage_chunk(server):
    body = {"messages": HI, "max_tokens": 4, "stream_options": {"include_usage": False}}
    chunks = sse(server, "/v1/chat/completions", body)
    assert chunks and all(c["choices"] and "usage" not in c for c in chunks)
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    chunks = sse(server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1


# -- errors ---------------------------------------------------------------------------------------
def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith((name + "{", name + " ")):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@pytest.mark.parametrize("prompt", ["x" * 200, ["short", "y" * 200], [[5] * 10, [6] * 128]],
                         ids=["text", "second-of-two", "token-ids"])
def test_prompt_over_max_model_len_is_400(server, prompt):
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and err["type"] == "BadRequestError" and "128" in err["message"]
    # a prompt accepted before the refused one is aborted with it
    assert eventually(lambda: not (metric(server, "vllm:num_requests_running")
                                   or metric(server, "vllm:num_requests_waiting")))
    still_serving(server)


CHAT_BAD = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
]


@pytest.mark.parametrize("body,param", CHAT_BAD, ids=[p + str(i) for i, (_, p) in enumerate(CHAT_BAD)])
def test_unsupported_chat_fields_are_400(server, client, body, param):
    r = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": HI, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == 400
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=HI, extra_body=body)
    still_serving(server)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content", [b"[1, 2]", b'"prompt"', b"3", b"null", b""])
def test_body_that_is_no_object_is_400(server, route, content):
    r = httpx.post(server + route, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "BadRequestError"
    still_serving(server)


def test_unknown_routes_are_fastapis_404_and_405(server):
    assert httpx.get(server + "/v1/nothing").status_code == 404
    assert httpx.post(server + "/v1/embeddings", json={"model": MODEL, "input": "x"}).status_code == 404
    assert httpx.get(server + "/v1/completions").status_code == 405
    assert httpx.delete(server + "/v1/chat/completions").status_code == 405
    still_serving(server)


def test_prompt_logprobs_as_vllm_returns_them(server):
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "abcd", "max_tokens": 2,
                                                      "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    ids = TOK.encode("abcd")
    assert len(plp) == len(ids) and plp[0] is None
    for tok, entry in zip(ids[1:], plp[1:]):
        assert str(tok) in entry and entry[str(tok)]["rank"] >= 1 and entry[str(tok)]["logprob"] <= 0
        assert min(e["rank"] for e in entry.values()) == 1
    chat = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "prompt_logprobs": 0,
                                                              "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["prompt_logprobs"][0] is None
    streamed = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True,
                                                             "prompt_logprobs": 1})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
