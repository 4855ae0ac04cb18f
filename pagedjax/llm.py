"""vLLM's offline entry point: `LLM(model, **engine_args).generate(prompts, sampling_params)`.

    from pagedjax import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

A thin loop over LLMEngine (pagedjax.engine): add the prompts, step until they finish, return the
outputs in the order of the prompts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

from pagedjax.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from pagedjax.engine import LLMEngine
from pagedjax.model.hub import LoadedModel
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """vLLM's offline entry point: `LLM(model, **engine_args).generate(prompts, sampling_params)`."""

    def __init__(self, model: str | LoadedModel = "smollm2-135m", *, warmup: bool | None = None, **kwargs):
        """`kwargs`: vLLM's engine arguments (see LLMEngine). Every shape bucket is compiled here,
        as vLLM prepares its CUDA graphs at start-up, so no `generate` waits for a compilation;
        with JAX's persistent compilation cache (pagedjax.compile_cache) a second process loads
        them instead. `warmup=False`, or vLLM's `enforce_eager=True`, compiles each bucket when a
        step first needs it instead. Default: True, unless $PAGEDJAX_WARMUP is 0."""
        eager = bool(kwargs.pop("enforce_eager", False))
        if warmup is None:
            warmup = not eager and os.environ.get("PAGEDJAX_WARMUP", "1").lower() not in ("0", "false", "no", "off")
        self.llm_engine = LLMEngine(model, **kwargs)
        if warmup:
            self.llm_engine.warmup()

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer (a transformers tokenizer; the tiny model's byte tokenizer)."""
        return self.llm_engine.tokenizer

    def warmup(self) -> float:
        return self.llm_engine.warmup()

    @property
    def params(self):
        """The weights generation runs with (see `update_weights`)."""
        return self.llm_engine.params

    def update_weights(self, params, *, abort: bool = False, wait: bool = False, copy: bool = True):
        """New weights of the same shapes, between steps, without compiling; the prefix cache is
        emptied (see LLMEngine.update_weights)."""
        return self.llm_engine.update_weights(params, abort=abort, wait=wait, copy=copy)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's LLM.reset_prefix_cache); False while requests hold blocks."""
        return self.llm_engine.scheduler.kv.reset_prefix_cache()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        """vLLM's spelling of calls to the workers, for the RL weight hook: collective_rpc("load_weights",
        args=(params,)) is update_weights(params). One engine here, so one result in the list."""
        calls = {"load_weights": self.update_weights, "update_weights": self.update_weights,
                 "reset_prefix_cache": self.reset_prefix_cache}
        if method not in calls:
            raise ValueError(f"collective_rpc: unknown method {method!r}; known: {sorted(calls)}")
        return [calls[method](*args, **(kwargs or {}))]

    def _add(self, prompts, sampling_params, output_kind: RequestOutputKind) -> list[str]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]   # one prompt: a string, a TextPrompt/TokensPrompt dict, or token ids
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts: pass one "
                             f"SamplingParams, or a list of exactly {len(prompts)}")
        # what this loop needs from the engine (as vLLM's LLM does): the final output, or deltas
        params = [sp.replace(output_kind=output_kind) if isinstance(sp, SamplingParams) else sp for sp in params]
        eng = self.llm_engine
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(eng.add_request(None, p, sp))
        except BaseException:
            for rid in ids:  # a bad prompt refuses the whole call: nothing of it keeps running
                eng.abort_request(rid)
            raise
        return ids

    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts (strings, token-id lists or {"prompt_token_ids": [...]}) to completion;
        outputs in the order of the prompts."""
        ids = self._add(prompts, sampling_params, RequestOutputKind.FINAL_ONLY)
        done: dict[str, RequestOutput] = {}
        for out in self._run(ids, use_tqdm):
            if out.finished:
                done[out.request_id] = out
        return [done[r] for r in ids]

    def _run(self, ids: list[str], use_tqdm: bool) -> Iterator[RequestOutput]:
        eng = self.llm_engine
        pending = set(ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        t0 = time.perf_counter()
        n_in = n_out = 0
        try:
            while pending:
                if not eng.has_unfinished_requests():
                    raise RuntimeError(f"{len(pending)} requests vanished without finishing")
                for out in eng.step():
                    if out.request_id not in pending:
                        continue
                    if out.finished:
                        pending.discard(out.request_id)
                        n_in += len(out.prompt_token_ids)
                        n_out += sum(len(o.token_ids) for o in out.outputs)
                        if bar is not None:
                            dt = max(time.perf_counter() - t0, 1e-9)
                            bar.set_postfix_str(f"input {n_in / dt:.0f} tok/s, output {n_out / dt:.0f} tok/s")
                            bar.update(1)
                    yield out
        except BaseException:
            # KeyboardInterrupt or an error mid-run: abort what this call added, so the engine is
            # left serving nothing of it and stays usable
            eng.abort_request(list(pending))
            raise
        finally:
            if bar is not None:
                bar.close()

    def stream(self, prompts, sampling_params=None) -> Iterator[RequestOutput]:
        """Yield RequestOutput deltas as the tokens are produced: each carries only the new token
        ids, text and logprobs of its samples since the request's previous output
        (RequestOutputKind.DELTA); the last one of a request has finished=True."""
        ids = self._add(prompts, sampling_params, RequestOutputKind.DELTA)
        yield from self._run(ids, use_tqdm=False)

    def chat(self, messages, sampling_params=None, *, use_tqdm: bool = True, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a list
        of them, through the model's chat template (or `chat_template`). A message's content may
        be a string or OpenAI content parts ([{"type": "text", "text": ...}, ...]), whose texts are
        joined by newlines. continue_final_message continues the last (assistant) message instead
        of starting a new one."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [render_chat(self.tokenizer, conv, chat_template=chat_template,
                               chat_template_kwargs=chat_template_kwargs, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message) for conv in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search as vLLM offers it (see pagedjax.beam_search): beams are requests that fork
        their parent's blocks copy-on-write, so every prefix the beams agree on is stored once."""
        return beam_search(self.llm_engine, prompts, params)


def render_chat(tokenizer, messages, *, chat_template: str | None = None, chat_template_kwargs: dict | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False) -> dict:
    """One conversation as the prompt the model's chat template (or `chat_template`) makes of it:
    {"prompt": text, "add_special_tokens": False}, since the template writes the special tokens
    itself (no second BOS)."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be True: set "
                         "add_generation_prompt=False to continue the final message")
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer with a chat template and the model has none")
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
    conv = [dict(m, content=_content_text(m.get("content"))) for m in messages]
    text = tokenizer.apply_chat_template(conv, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, tokenize=False,
                                         **(chat_template_kwargs or {}))
    return {"prompt": text, "add_special_tokens": False}


def _content_text(content) -> str:
    """A message's content as text: a string as it is, OpenAI content parts' texts joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"only text content parts are supported, got a part of type {kind!r}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"message content must be a string or a list of content parts, got {type(content).__name__}")
