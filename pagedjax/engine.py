"""The engine and the API a vLLM user already knows.

    from pagedjax import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

One request's path: `LLM.generate` -> `LLMEngine.add_request` (tokenize, validate, seed) ->
`Scheduler.add_request`; then each `LLMEngine.step()`: `Scheduler.schedule()` decides the step,
`BatchPacker.pack()` writes the fixed-shape numpy inputs, `ModelRunner.execute()` runs the jitted
step (the Pallas kernel or the reference inside), `Scheduler.update_from_output()` appends the
sampled tokens, finishes requests and frees their blocks, and the engine turns them into
`RequestOutput`s.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.config import EngineConfig
from pagedjax.metrics import RequestRecord
from pagedjax.model.llama import ModelConfig, init_random_params
from pagedjax.pallas.common import check_supported, device_limits
from pagedjax.parallel import check_tensor_parallel, param_bytes_per_device
from pagedjax.attention import resolve_backend
from pagedjax.runner import ModelRunner
from pagedjax.sampling_params import SamplingParams
from pagedjax.scheduler.batch import BatchPacker
from pagedjax.scheduler.scheduler import Scheduler
from pagedjax.scheduler.sequence import Request, RequestStatus

logger = logging.getLogger(__name__)


TINY_RANDOM = ModelConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                          tie_word_embeddings=True, max_position_embeddings=4096, bos_token_id=1,
                          eos_token_ids=(2,), architecture="LlamaForCausalLM")


class ByteTokenizer:
    """The tiny random model's tokenizer: UTF-8 bytes shifted past the special ids (0 pad, 1 bos,
    2 eos), so any string round-trips."""

    offset = 3
    eos_token_id = 2
    bos_token_id = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - self.offset for i in ids if self.offset <= i < 256 + self.offset).decode("utf-8", "replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **_):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return self.encode(text) if tokenize else text


class LoadedModel(NamedTuple):
    """A model's config, weights and tokenizer, as `load_any_model` returns them. Pass one as
    `LLMEngine(model=...)` to build several engines (say, one per block size) on weights loaded
    and dequantized once."""

    model_config: ModelConfig
    params: Any
    tokenizer: Any


def load_any_model(model: str, dtype: Any, seed: int) -> LoadedModel:
    """`model`: a HF directory, a .gguf file, "smollm2-135m" or "tiny-random"."""
    if model == "tiny-random":
        return LoadedModel(TINY_RANDOM, init_random_params(TINY_RANDOM, jax.random.key(seed), dtype), ByteTokenizer())
    from pagedjax.model.weights import load_model

    if model in ("smollm2-135m", "smollm2", "default"):
        from pagedjax.model.hub import default_model_path

        model = str(default_model_path())
    return LoadedModel(*load_model(model, dtype))


# -- outputs ---------------------------------------------------------------------------------------
@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None
    logprobs: list | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: list[RequestRecord] = field(default_factory=list)
    num_cached_tokens: int = 0


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    members: dict[int, Request] = field(default_factory=dict)
    texts: dict[int, str] = field(default_factory=dict)
    stop_reasons: dict[int, Any] = field(default_factory=dict)


class LLMEngine:
    def __init__(self, model: str | LoadedModel = "smollm2-135m", *, dtype: str | Any = "float32", max_logprobs: int = 20,
                 logits_hook=None, **config_kwargs):
        self.config = config = EngineConfig(**config_kwargs)
        self.dtype = _float_dtype(dtype)
        if isinstance(model, LoadedModel):
            self.model_config, params, self.tokenizer = model
            params = jax.tree.map(lambda w: w.astype(self.dtype) if w.dtype != self.dtype else w, params)
        else:
            self.model_config, params, self.tokenizer = load_any_model(model, self.dtype, config.seed)
        mc = self.model_config
        if config.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({mc.max_position_embeddings})")
        if mc.sliding_window is not None and config.max_model_len > mc.sliding_window:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's sliding_window "
                             f"({mc.sliding_window}); attention here is full, so keep sequences inside the window")
        check_tensor_parallel(config.tensor_parallel_size, mc)  # before sizing the pool per device
        self.backend = resolve_backend(config.attention_backend, config.tensor_parallel_size)
        if self.backend == "pallas":
            # refused here, naming the limit, rather than by the compiler in the first step
            check_supported(head_dim=mc.head_dim, num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads,
                            block_size=config.block_size, dtype=self.dtype, limits=device_limits())
        num_blocks = config.num_blocks or self._default_num_blocks(params)
        need = config.max_blocks_per_seq
        if num_blocks - 1 < need:
            raise ValueError(f"num_blocks ({num_blocks}) leaves {num_blocks - 1} usable blocks, fewer than one "
                             f"max_model_len ({config.max_model_len}) request needs ({need} blocks of "
                             f"{config.block_size}); raise num_blocks or lower max_model_len")
        config.num_blocks = num_blocks
        num_host = 0
        if config.preemption_mode == "swap":
            num_host = num_blocks if config.num_host_blocks is None else config.num_host_blocks
        self.scheduler = Scheduler(config, num_blocks)
        self.packer = BatchPacker(config)
        self.runner = ModelRunner(mc, params, config, num_blocks, num_host_blocks=num_host,
                                  num_logprobs=max_logprobs, logits_hook=logits_hook)
        self.max_logprobs = max_logprobs
        self.eos_token_ids = set(mc.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._rng = random.Random(config.seed)
        self._groups: dict[str, _Group] = {}
        self._counter = 0
        self.warmup_seconds = None
        self.compilations_at_warmup = None

    def _default_num_blocks(self, params) -> int:
        """CPU: room for every seat at max_model_len. GPU/TPU: gpu_memory_utilization of the
        device memory, less the weights, as vLLM sizes it."""
        cfg, mc = self.config, self.model_config
        # per device: with tensor_parallel_size N each device holds num_kv_heads / N of every block
        tp = cfg.tensor_parallel_size
        per_block = 2 * mc.num_layers * (mc.num_kv_heads // tp) * cfg.block_size * mc.head_dim * self.dtype.itemsize
        dev = jax.devices()[0]
        stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
        if dev.platform == "cpu" or not stats or "bytes_limit" not in stats:
            return cfg.max_num_seqs * cfg.max_blocks_per_seq + 1
        weights = param_bytes_per_device(params, tp)
        budget = stats["bytes_limit"] * cfg.gpu_memory_utilization - weights - stats.get("bytes_in_use", 0)
        # leave room for activations of the largest step
        budget -= 4 * max(cfg.token_buckets) * mc.hidden_size * 64 + 2 * max(cfg.seq_buckets) * mc.vocab_size * 4
        return max(2, int(budget // per_block))

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | dict | Sequence[int] | None,
                    params: SamplingParams | None = None, arrival_time: float | None = None) -> str:
        """Accept a request (refused at once with ValueError if it could never run)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id is None:  # the next number no live request already uses as its id
            while str(self._counter) in self._groups or str(self._counter) in self.scheduler.requests:
                self._counter += 1
            request_id = str(self._counter)
            self._counter += 1
        request_id = str(request_id)
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        text, ids = self._tokenize(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids must be ints in [0, vocab_size={vocab}); got {bad[:5]}")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer and the model has none: use stop_token_ids")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(f"logprobs ({params.logprobs}) exceeds max_logprobs ({self.max_logprobs})")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        eos = None if not self.eos_token_ids else min(self.eos_token_ids)
        stop_ids = list(params.stop_token_ids or [])
        if len(self.eos_token_ids) > 1 and not params.ignore_eos:
            stop_ids += sorted(self.eos_token_ids - {eos})
        if stop_ids != list(params.stop_token_ids or []):
            params = _with(params, stop_token_ids=stop_ids)
        req = Request(request_id, [int(t) for t in ids], params,
                      arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
                      eos_token_id=eos, seed=seed)
        self.scheduler.add_request(req)  # validates lengths against max_model_len and the pool
        self._groups[request_id] = _Group(request_id, text, req.prompt_token_ids, params, {0: req})
        return request_id

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the model has no tokenizer: pass "
                                 "{'prompt_token_ids': [...]} instead")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise ValueError("prompt is empty: it must contain at least 1 token")
            return prompt, list(ids)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            else:
                raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = list(prompt)
        else:
            raise ValueError(f"prompt must be a string, a token id list or a dict, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt_token_ids is empty: it must contain at least 1 token")
        return None, ids

    def abort_request(self, request_id: str) -> None:
        """Abort a request and every sample of it, from any state; its blocks return at once."""
        if request_id not in self._groups:
            raise ValueError(f"request_id {request_id!r} is not an unfinished request")
        for req in self._groups[request_id].members.values():
            if not req.is_finished:
                self.scheduler.abort_request(req.request_id)
        del self._groups[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    # -- one step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run and apply one step; returns an output for every request that progressed.

        If the device step raises, the step is rolled back on the host before the exception
        propagates: no token is appended, the blocks allocated for it stay with their requests
        (their content is recomputed next time), and the engine stays usable."""
        sched = self.scheduler
        out = sched.schedule()
        if out.is_empty:
            return []
        step = self.packer.pack(out, sched.kv)
        try:
            tokens, logprob, top_ids, top_lps, errors = self.runner.execute(out, step)
        except BaseException:
            self._rollback(out)
            raise
        lps = None
        if any(r.sampling_params.logprobs is not None for r in out.scheduled):
            lps = [(float(logprob[i]), top_ids[i].tolist(), top_lps[i].tolist()) for i in range(out.num_rows)]
        changed = sched.update_from_output(out, tokens, logprobs=lps, errors=errors)
        return self._outputs(changed)

    def _rollback(self, out) -> None:
        """The step did not run. Nothing was appended and num_computed_tokens only advances in
        update_from_output, so the same work is scheduled again; the blocks registered for it
        are forgotten (they were never filled), and samples forked in this step, whose KV was
        never written, are sent back to be recomputed from their prompt."""
        sched = self.scheduler
        sched.kv.rollback_step(out.scheduled)
        for req, n in zip(out.scheduled, out.num_new_tokens):
            if n == 0 and req.status == RequestStatus.RUNNING:
                sched.running.remove(req)
                sched._release_seat(req)
                sched.kv.free(req.request_id)
                req.num_computed_tokens = 0
                req.status = RequestStatus.PREEMPTED
                sched.waiting.appendleft(req)

    def _outputs(self, changed: list[Request]) -> list[RequestOutput]:
        touched: dict[str, _Group] = {}
        for req in changed:
            group = self._groups.get(req.group_id)
            if group is None:
                continue
            group.members.setdefault(req.sample_index, req)
            self._check_stop_strings(group, req)
            touched[group.request_id] = group
        outs = []
        for gid, group in touched.items():
            out = self._make_output(group)
            outs.append(out)
            if out.finished:
                del self._groups[gid]
        return outs

    def _check_stop_strings(self, group: _Group, req: Request) -> None:
        stops = group.params.stop_strings
        if not stops or req.is_finished:
            return
        text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        for s in stops:
            i = text.find(s)
            if i >= 0:
                group.texts[req.sample_index] = text[:i]
                group.stop_reasons[req.sample_index] = s
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                return

    def _make_output(self, group: _Group) -> RequestOutput:
        n = group.params.n
        members = [group.members.get(i) for i in range(n)]
        finished = all(m is not None and m.is_finished for m in members)
        parent = members[0]
        if parent.is_finished and parent.children == [] and parent.sampling_params.n > 1 and not parent.forked:
            finished = True  # ended before its prompt completed (abort, error): no samples were forked
        outputs = []
        for i, m in enumerate(members):
            if m is None:
                continue
            text = group.texts.get(i)
            if text is None and self.tokenizer is not None and (m.is_finished or group.params.stop_strings):
                text = self.tokenizer.decode(m.output_token_ids, skip_special_tokens=True)
            lp = m.output_logprobs if group.params.logprobs is not None else None
            cum = float(sum(x[0] for x in lp)) if lp else None
            stop_reason = group.stop_reasons.get(i)
            if stop_reason is None and m.status == RequestStatus.FINISHED_STOPPED and m.output_token_ids:
                stop_reason = m.output_token_ids[-1] if m.output_token_ids[-1] != m.eos_token_id else None
            outputs.append(CompletionOutput(i, text or "", list(m.output_token_ids), m.finish_reason, cum,
                                            _format_logprobs(m.output_token_ids, lp, group.params.logprobs),
                                            stop_reason))
        recs = [m.record for m in members if m is not None and m.record is not None] if finished else []
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, finished, recs,
                             max(parent.num_cached_tokens, 0))

    # -- warm-up and stats -----------------------------------------------------------------------
    def buckets(self) -> list[tuple[int, int, int]]:
        """Every (T, S, P) shape the packer can produce (S follows T: see BatchPacker)."""
        cfg = self.config
        return sorted({(T, self.packer.rows_for(T), P) for T in cfg.token_buckets for P in cfg.page_buckets})

    def warmup(self) -> float:
        """Compile every bucket now, so no request ever waits for a compilation."""
        dt = self.runner.warmup(self.buckets())
        self.warmup_seconds = dt
        self.compilations_at_warmup = self.runner.num_compilations
        return dt

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations


def _float_dtype(dtype) -> jnp.dtype:
    """The params' and KV cache's dtype: one the model and the attention kernels compute in."""
    allowed = ("float32", "bfloat16", "float16")
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in allowed:
        raise ValueError(f"dtype must be one of {', '.join(allowed)}, got {dtype!r}")
    return dt


def _with(params: SamplingParams, **changes) -> SamplingParams:
    kw = {f: getattr(params, f) for f in ("n", "temperature", "top_k", "top_p", "min_p", "seed", "stop",
                                          "stop_token_ids", "max_tokens", "ignore_eos", "logprobs")}
    kw.update(changes)
    return SamplingParams(**kw)


def _format_logprobs(token_ids, lp, k):
    """Per generated token: {token id: logprob} for the top k and the sampled token (vLLM's shape)."""
    if lp is None:
        return None
    out = []
    for tok, (sampled_lp, ids, vals) in zip(token_ids, lp):
        d = dict(zip(ids[:k], vals[:k]))
        d[tok] = sampled_lp
        out.append(d)
    return out


# -- the offline API ---------------------------------------------------------------------------------
@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"BeamSearchParams.beam_width must be an int >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")


@dataclass
class BeamSequence:
    tokens: list[int]          # prompt + generated
    cum_logprob: float
    text: str | None = None
    finished: bool = False


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSequence]
    physical_blocks_peak: int = 0      # blocks the beams held at once (shared blocks counted once)
    cloned_blocks_peak: int = 0        # what cloning every beam's whole cache would have taken


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
            for rid in list(pending):
                if rid in eng._groups:
                    eng.abort_request(rid)
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
        """Beam search as vLLM offers it: beams are requests that fork their parent's blocks
        copy-on-write, so every prefix the beams agree on is stored once."""
        eng = self.llm_engine
        sched = eng.scheduler
        k = params.beam_width
        if 2 * k > eng.max_logprobs:
            raise ValueError(f"beam_width ({k}) needs 2 x beam_width <= max_logprobs ({eng.max_logprobs})")
        if k > eng.config.max_num_seqs:
            raise ValueError(f"beam_width ({k}) exceeds max_num_seqs ({eng.config.max_num_seqs})")
        results = []
        for prompt in ([prompts] if isinstance(prompts, (str, dict)) else list(prompts)):
            results.append(self._beam_search_one(prompt, params))
        return results

    def _beam_search_one(self, prompt, params: BeamSearchParams) -> BeamSearchOutput:
        eng = self.llm_engine
        sched = eng.scheduler
        k = params.beam_width
        eos = None if params.ignore_eos else (min(eng.eos_token_ids) if eng.eos_token_ids else None)
        # beams run greedy with their top-2k candidates; the search, not the scheduler, decides
        # when a beam ends, so the scheduler's own limit is one token further out
        sp = SamplingParams(temperature=0, max_tokens=params.max_tokens + 1, ignore_eos=True, logprobs=2 * k)
        root = eng.add_request(None, prompt, sp)
        prompt_len = len(eng._groups[root].prompt_token_ids)
        beams: dict[str, float] = {root: 0.0}     # live request id -> cumulative logprob
        finished: list[BeamSequence] = []
        peak_phys = peak_clone = 0
        forks = 0
        try:
            for n in range(1, params.max_tokens + 1):
                # run until every live beam has sampled its n-th token (and its candidates)
                while any(sched.requests[rid].num_output_tokens < n for rid in beams):
                    eng.step()
                live = {rid: sched.requests[rid] for rid in beams}
                cands = sorted(((beams[rid] + lp, rid, tok)
                                for rid, req in live.items() for tok, lp in zip(*req.output_logprobs[-1][1:])),
                               key=lambda c: -c[0])
                chosen = []
                for score, rid, tok in cands:
                    if eos is not None and tok == eos:
                        if len(finished) < k:
                            finished.append(BeamSequence(live[rid].all_token_ids[:-1] + [tok], score, finished=True))
                        continue
                    chosen.append((score, rid, tok))
                    if len(chosen) == k:
                        break
                new_beams: dict[str, float] = {}
                for score, rid, tok in chosen:
                    parent = live[rid]
                    if rid not in new_beams:  # the first continuation of a beam keeps its request
                        target = parent
                    else:
                        forks += 1
                        target = _fork_beam(sched, parent, f"{root}~{forks}")
                    # the n-th token is not computed yet: the chosen candidate replaces the greedy one
                    target.all_token_ids[-1] = tok
                    target.output_token_ids[-1] = tok
                    new_beams[target.request_id] = score
                for rid in live:
                    if rid not in new_beams:
                        sched.abort_request(rid)
                peak_phys = max(peak_phys, sched.kv.usage().used_blocks)
                peak_clone = max(peak_clone, sum(len(sched.kv.req_to_blocks[r]) for r in new_beams))
                beams = new_beams
                if not beams:
                    break
                if eos is not None and len(finished) >= k:
                    best_live = max(beams.values()) / (n ** params.length_penalty)
                    if min(_beam_score(f, prompt_len, params.length_penalty) for f in finished) >= best_live:
                        break  # no live beam can overtake the finished ones any more
            for rid, score in beams.items():
                finished.append(BeamSequence(list(sched.requests[rid].all_token_ids), score, finished=True))
        finally:
            for rid in list(beams):
                if rid in sched.requests:
                    sched.abort_request(rid)
            eng._groups.pop(root, None)
        finished.sort(key=lambda b: -_beam_score(b, prompt_len, params.length_penalty))
        for b in finished:
            if eng.tokenizer is not None:  # a HF directory without tokenizer files: token ids only
                b.text = eng.tokenizer.decode(b.tokens[prompt_len:], skip_special_tokens=True)
        return BeamSearchOutput(finished[:k], peak_phys, peak_clone)


def _fork_beam(sched: Scheduler, parent: Request, request_id: str) -> Request:
    """A new beam sharing every block of `parent` copy-on-write."""
    child = Request(request_id, parent.prompt_token_ids, parent.sampling_params, arrival_time=parent.arrival_time,
                    eos_token_id=parent.eos_token_id, seed=parent.seed, group_id=request_id)
    child.all_token_ids = list(parent.all_token_ids)
    child.output_token_ids = list(parent.output_token_ids)
    child.output_logprobs = list(parent.output_logprobs)
    child.times = _copy_times(parent.times)
    sched.fork_request(parent.request_id, child)
    return child


def _beam_score(b: BeamSequence, prompt_len: int, length_penalty: float) -> float:
    """Cumulative logprob / generated length ** length_penalty (HF's and vLLM's ranking)."""
    n = max(len(b.tokens) - prompt_len, 1)
    return b.cum_logprob / (n ** length_penalty)


def _copy_times(t):
    from pagedjax.scheduler.sequence import RequestTimes

    return RequestTimes(t.arrival, t.first_scheduled, t.first_token, list(t.token_times), t.finished)
