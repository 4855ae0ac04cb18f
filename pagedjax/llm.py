"""vLLM's offline entry point: `LLM(model, **engine_args).generate(prompts, sampling_params)`.

    from pagedjax import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

A thin loop over LLMEngine (pagedjax.engine): add the prompts, step until they finish, return the
outputs in the order of the prompts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from pagedjax.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from pagedjax.engine import LLMEngine
from pagedjax.model.hub import LoadedModel
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams


class LLM:
    """vLLM's offline entry point: `LLM(model, **engine_args).generate(prompts, sampling_params)`."""

    def __init__(self, model: str | LoadedModel = "smollm2-135m", **kwargs):
        self.llm_engine = LLMEngine(model, **kwargs)

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def warmup(self) -> float:
        return self.llm_engine.warmup()

    def _add(self, prompts, sampling_params) -> list[str]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts: pass one "
                             f"SamplingParams, or a list of exactly {len(prompts)}")
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
        ids = self._add(prompts, sampling_params)
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

    def stream(self, prompts, sampling_params=None) -> Iterator[tuple[str, int, list[int]]]:
        """Yield (request_id, sample index, new token ids) as the tokens are produced."""
        ids = self._add(prompts, sampling_params)
        seen: dict[tuple[str, int], int] = {}
        for out in self._run(ids, use_tqdm=False):
            for o in out.outputs:
                k = (out.request_id, o.index)
                new = o.token_ids[seen.get(k, 0):]
                if new:
                    seen[k] = len(o.token_ids)
                    yield out.request_id, o.index, new

    def chat(self, messages, sampling_params=None, *, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt, tokenize=False)
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search as vLLM offers it (see pagedjax.beam_search): beams are requests that fork
        their parent's blocks copy-on-write, so every prefix the beams agree on is stored once."""
        return beam_search(self.llm_engine, prompts, params)
