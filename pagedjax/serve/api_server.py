"""An OpenAI-compatible HTTP server on the engine (FastAPI + uvicorn, as vLLM's).

    pagedjax serve smollm2-135m --port 8000 --max-model-len 1024 --max-num-seqs 32
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 16}'

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with `stream`:
server-sent events ending `data: [DONE]`), GET /health, GET /metrics (pagedjax.serve.metrics).
Every request becomes one engine request per prompt (its `n` samples share the prompt's blocks),
added to the one engine loop (pagedjax.serve.async_llm) that steps while any request is
unfinished. A bad request is answered 400 with the field and its limit named, an unknown model
404; nothing in flight is affected. A streaming client that disconnects has its request aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from pagedjax.llm import render_chat
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.serve import protocol
from pagedjax.serve.async_llm import AsyncLLM
from pagedjax.serve.metrics import ServerMetrics
from pagedjax.serve.protocol import APIError

logger = logging.getLogger(__name__)


def build_app(llm: AsyncLLM, served_model_name: str) -> FastAPI:
    metrics = ServerMetrics(served_model_name)
    llm.on_step = metrics.on_step
    llm.on_idle = metrics.refresh
    llm.on_finished = metrics.on_finished
    engine = llm.engine
    tokenizer = engine.tokenizer

    @contextlib.asynccontextmanager
    async def lifespan(app):
        llm.start()
        yield
        await llm.shutdown()   # SIGINT/SIGTERM: uvicorn stops accepting, in-flight requests are aborted

    app = FastAPI(title="pagedjax", lifespan=lifespan)
    app.state.llm, app.state.metrics = llm, metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    async def body_of(request: Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != served_model_name:
            raise APIError(f"The model `{model}` does not exist.", "model", 404)
        return body

    @app.get("/health")
    async def health():
        if not llm.is_running:
            raise APIError("the engine loop is not running", status=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": protocol.now(),
                                            "owned_by": "pagedjax", "root": served_model_name,
                                            "max_model_len": engine.config.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        prompts, params, opts = protocol.parse_completion(body)
        if opts["echo"] and opts["logprobs"] is not None:
            params.prompt_logprobs = opts["logprobs"]   # echoed prompt tokens come with their logprobs
        rid, created = protocol.new_id("cmpl"), protocol.now()
        gens = await _start(llm, [(f"{rid}-{i}", p, params) for i, p in enumerate(prompts)])
        head = {"id": rid, "object": "text_completion", "created": created, "model": served_model_name}
        if opts["stream"]:
            return _sse(_completion_chunks(gens, head, params.n, opts, tokenizer))
        finals = await _finals(gens)
        choices, usage_in = [], 0
        for i, out in enumerate(finals):
            usage_in += len(out.prompt_token_ids)
            for c in out.outputs:
                text, echoed = c.text, None
                if opts["echo"]:
                    text = _prompt_text(out, tokenizer) + text
                    echoed = _prompt_logprob_rows(out, out.prompt_logprobs, opts, tokenizer)
                choice = {"index": i * params.n + c.index, "text": text,
                          "logprobs": _completion_logprobs(c, opts, echoed),
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if body.get("prompt_logprobs") is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs_json(out)
                choices.append(choice)
        usage_out = sum(len(c.token_ids) for o in finals for c in o.outputs)
        return {**head, "choices": choices, "usage": protocol.usage(usage_in, usage_out)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request)
        messages, params, opts = protocol.parse_chat(body)
        try:
            prompt = render_chat(tokenizer, messages, **opts["chat"])
        except (ValueError, TypeError) as e:
            raise APIError(str(e), "messages") from None
        rid, created = protocol.new_id("chatcmpl"), protocol.now()
        gens = await _start(llm, [(rid, prompt, params)], prompt_field="messages")
        head = {"id": rid, "object": "chat.completion.chunk" if opts["stream"] else "chat.completion",
                "created": created, "model": served_model_name}
        if opts["stream"]:
            return _sse(_chat_chunks(gens[0], head, params.n, opts, tokenizer))
        out = (await _finals(gens))[0]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": _chat_logprobs(c, opts, tokenizer), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in out.outputs]
        response = {**head, "choices": choices,
                    "usage": protocol.usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))}
        if body.get("prompt_logprobs") is not None:
            response["prompt_logprobs"] = _prompt_logprobs_json(out)
        return response

    return app


# -- running requests -------------------------------------------------------------------------------
async def _start(llm: AsyncLLM, requests, prompt_field: str = "prompt") -> list[AsyncIterator[RequestOutput]]:
    """Add every prompt of a call, or none: a prompt the engine refuses aborts the ones before it.
    A refusal that names no other field is about the prompt (`prompt_field`: what the client sent)."""
    gens, accepted = [], []
    try:
        for rid, prompt, params in requests:
            gens.append(await llm.add_request(rid, prompt, params))
            accepted.append(rid)
    except ValueError as e:
        for rid in accepted:
            llm.abort(rid)
        raise APIError(str(e), protocol.param_of(str(e), protocol.COMPLETION_FIELDS | protocol.CHAT_FIELDS)
                       or prompt_field) from None
    return gens


async def _finals(gens) -> list[RequestOutput]:
    async def last(gen):
        out = None
        async with contextlib.aclosing(gen):
            async for out in gen:
                pass
        return out
    return list(await asyncio.gather(*(last(g) for g in gens)))


async def _merged(gens):
    """(prompt index, RequestOutput) from several requests as they come; closing it aborts them all."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, gen):
        try:
            async with contextlib.aclosing(gen):
                async for out in gen:
                    await q.put((i, out))
        except Exception as e:
            await q.put((i, e))
        await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _sse(chunks) -> StreamingResponse:
    async def events():
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as e:   # the engine failed mid-stream: say so in the stream, as vLLM does
            logger.exception("stream failed")
            yield f"data: {json.dumps(APIError(str(e), status=500).body())}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


async def _completion_chunks(gens, head, n, opts, tokenizer):
    usage_in, usage_out, done = 0, 0, set()
    sent: dict[tuple[int, int], int] = {}   # text each choice has had so far: its logprobs' text_offset goes on
    prompt_logprobs: dict[int, list] = {}   # a DELTA request carries them in one output only; n samples share them
    async for i, out in _merged(gens):
        if out.prompt_logprobs is not None:
            prompt_logprobs[i] = out.prompt_logprobs
        for c in out.outputs:
            if (i, c.index) in done or not (c.text or c.token_ids or c.finish_reason):
                continue   # a DELTA output repeats samples with nothing new, and finished ones
            if c.finish_reason:
                done.add((i, c.index))
            text, echoed = c.text, None
            if opts["echo"] and (i, c.index) not in sent:   # the prompt (and its logprobs) lead a choice's first chunk
                text = _prompt_text(out, tokenizer) + text
                echoed = _prompt_logprob_rows(out, prompt_logprobs.get(i), opts, tokenizer)
            offset = sent.get((i, c.index), 0)
            sent[(i, c.index)] = offset + len(text)
            usage_out += len(c.token_ids)
            yield {**head, "choices": [{"index": i * n + c.index, "text": text,
                                        "logprobs": _completion_logprobs(c, opts, echoed, offset),
                                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
        if out.finished:
            usage_in += len(out.prompt_token_ids)
    if opts["include_usage"]:
        yield {**head, "choices": [], "usage": protocol.usage(usage_in, usage_out)}


async def _chat_chunks(gen, head, n, opts, tokenizer):
    started, done, usage_out, usage_in = set(), set(), 0, 0
    async for _, out in _merged([gen]):
        for c in out.outputs:
            if c.index in done or not (c.text or c.token_ids or c.finish_reason):
                continue   # a DELTA output repeats samples with nothing new, and finished ones
            if c.finish_reason:
                done.add(c.index)
            if c.index not in started:
                started.add(c.index)
                yield {**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
            usage_out += len(c.token_ids)
            yield {**head, "choices": [{"index": c.index, "delta": {"content": c.text} if c.text else {},
                                        "logprobs": _chat_logprobs(c, opts, tokenizer),
                                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
        if out.finished:
            usage_in = len(out.prompt_token_ids)
    if opts["include_usage"]:
        yield {**head, "choices": [], "usage": protocol.usage(usage_in, usage_out)}


# -- logprobs in the OpenAI shapes --------------------------------------------------------------------
def _token_text(token_id: int, decoded: str | None, as_id: bool = False) -> str:
    return decoded if decoded is not None and not as_id else f"token_id:{token_id}"


def _logprob(x: float) -> float:
    """-inf (a banned token among the top ones) as OpenAI's -9999.0: JSON has no infinity."""
    return max(x, -9999.0)


def _completion_logprobs(c: CompletionOutput, opts: dict, echoed: list | None = None, offset: int = 0) -> dict | None:
    """A choice's tokens in the Completions shape, after the echoed prompt's rows (`echoed`) if
    any; text offsets count on from `offset`, the text the choice's earlier chunks held. As in
    vLLM (and OpenAI), top_logprobs has the top `logprobs` and the sampled token: logprobs=0
    gives the sampled token alone, never null."""
    k, as_id = opts["logprobs"], opts["token_ids"]
    if k is None or c.logprobs is None:
        return None
    rows = list(echoed or ())
    for t, d in zip(c.token_ids, c.logprobs):
        rows.append((_token_text(t, d[t].decoded_token, as_id), _logprob(d[t].logprob),
                     {_token_text(tid, lp.decoded_token, as_id): _logprob(lp.logprob) for tid, lp in d.items()}))
    offsets = []
    for tok, _, _ in rows:
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
            "top_logprobs": [r[2] for r in rows], "text_offset": offsets}


def _prompt_logprob_rows(out: RequestOutput, prompt_logprobs: list | None, opts: dict, tokenizer) -> list | None:
    """The echoed prompt's (token, logprob, top logprobs): None and None for the first token,
    which nothing predicts. None when no logprobs were asked for."""
    if opts["logprobs"] is None:
        return None
    rows, as_id = [], opts["token_ids"]
    for j, t in enumerate(out.prompt_token_ids):
        d = prompt_logprobs[j] if prompt_logprobs else None
        if d is None:
            rows.append((_token_text(t, tokenizer.decode([t]) if tokenizer is not None else None, as_id), None, None))
        else:
            rows.append((_token_text(t, d[t].decoded_token, as_id), _logprob(d[t].logprob),
                         {_token_text(tid, lp.decoded_token, as_id): _logprob(lp.logprob) for tid, lp in d.items()}))
    return rows


def _chat_logprobs(c: CompletionOutput, opts: dict, tokenizer) -> dict | None:
    if not opts["logprobs"] or c.logprobs is None:
        return None
    content = []
    for t, d in zip(c.token_ids, c.logprobs):
        def entry(tid, lp):
            text = _token_text(tid, lp.decoded_token, opts["token_ids"])
            return {"token": text, "logprob": _logprob(lp.logprob), "bytes": list(text.encode("utf-8"))}
        top = sorted(((tid, lp) for tid, lp in d.items() if lp.rank is not None and lp.rank <= opts["top_logprobs"]),
                     key=lambda x: x[1].rank)
        content.append({**entry(t, d[t]), "top_logprobs": [entry(tid, lp) for tid, lp in top]})
    return {"content": content}


def _prompt_logprobs_json(out: RequestOutput) -> list | None:
    """vLLM's prompt_logprobs in a response: per prompt token None (the first) or
    {token id: {"logprob", "rank", "decoded_token"}}."""
    if out.prompt_logprobs is None:
        return None
    return [None if d is None else {str(t): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in d.items()}
            for d in out.prompt_logprobs]


def _prompt_text(out: RequestOutput, tokenizer) -> str:
    if out.prompt is not None:
        return out.prompt
    return tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""
