"""LLMEngine: vLLM's engine loop over the scheduler, the packer and the runner.

One request's path: `LLM.generate` (pagedjax.llm) -> `LLMEngine.add_request` (tokenize, validate,
seed) -> `Scheduler.add_request`; then each `LLMEngine.step()`: `Scheduler.schedule()` decides the
step, `BatchPacker.pack()` fills the fixed-shape StepInput, `ModelRunner.dispatch()` starts the
jitted step (model, attention, sampling) and `Scheduler.advance()` counts its tokens as computed;
`ModelRunner.fetch()` waits for the sampled tokens, `Scheduler.resolve()` appends them, finishes
requests and frees their blocks, and the engine turns them into `RequestOutput`s
(pagedjax.outputs). With async scheduling, the next step is scheduled between the two halves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.attention import resolve_backend
from pagedjax.compile_cache import enable_compilation_cache
from pagedjax.config import EngineConfig, platform_token_buckets
from pagedjax.engine_args import EngineArgs, split_engine_kwargs
from pagedjax.metrics import StepTiming, step_shape
from pagedjax.model.hub import LoadedModel, prepare_model
from pagedjax.output_processor import OutputProcessor
from pagedjax.outputs import RequestOutput
from pagedjax.pallas.common import check_supported, device_limits
from pagedjax.parallel import check_tensor_parallel, param_bytes_per_device
from pagedjax.runner import Dispatched, ModelRunner
from pagedjax.sampling_params import SamplingParams
from pagedjax.scheduler.batch import BatchPacker
from pagedjax.scheduler.logits_inputs import LogitsPacker
from pagedjax.scheduler.output import SchedulerOutput
from pagedjax.scheduler.scheduler import Scheduler
from pagedjax.scheduler.sequence import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _InFlight:
    """A launched step: what was scheduled, the device's handle, its timings so far."""

    out: SchedulerOutput
    handle: Dispatched
    timing: StepTiming


class LLMEngine:
    def __init__(self, model: str | LoadedModel = "smollm2-135m", *, dtype: str | Any = "auto", max_logprobs: int = 20,
                 logits_hook=None, **kwargs):
        """`model`: a built-in name, a HF directory, a .gguf file, a Hugging Face hub id or a
        LoadedModel. `dtype`: float32, bfloat16, float16, or "auto": the checkpoint's dtype; on a
        CPU float32, where XLA's half-precision matmuls are slower and less exact. `kwargs`: vLLM's
        engine arguments (pagedjax.engine_args): EngineConfig's knobs, the model's source
        (revision, download_dir, tokenizer, ...), others checked or accepted with a warning."""
        config_kwargs, source = split_engine_kwargs(kwargs)
        self.config = config = EngineConfig(**config_kwargs)
        enable_compilation_cache()   # before anything compiles (pagedjax.compile_cache)
        (self.model_config, params, self.tokenizer), self.dtype = prepare_model(model, dtype, config.seed, **source)
        mc = self.model_config
        if config.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({mc.max_position_embeddings})")
        if mc.sliding_window is not None and config.max_model_len > mc.sliding_window:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's sliding_window "
                             f"({mc.sliding_window}); attention here is full, so keep sequences inside the window")
        check_tensor_parallel(config.tensor_parallel_size, mc)  # before sizing the pool per device
        self.backend = resolve_backend(config.attention_backend, config.tensor_parallel_size)
        if config.default_token_buckets:
            config.token_buckets = platform_token_buckets(config.max_num_batched_tokens, jax.default_backend())
        if self.backend == "native" and config.default_page_buckets:
            # the native kernel reads each row's pages up to its context whatever the tables' width,
            # so one width costs nothing and leaves one program per token bucket to compile
            config.page_buckets = (config.max_blocks_per_seq,)
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
        self.logits_packer = LogitsPacker(mc.vocab_size, config.max_model_len)
        self.runner = ModelRunner(mc, params, config, num_blocks, num_host_blocks=num_host,
                                  kv_dtype=None if config.kv_cache_dtype == "auto" else config.kv_cache_dtype,
                                  num_logprobs=max_logprobs, logits_hook=logits_hook)
        self.max_logprobs = max_logprobs
        self.eos_token_ids = set(mc.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._rng = random.Random(config.seed)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._counter = 0
        self.warmup_seconds = None
        self.weights_version = 0                # update_weights calls so far
        self.last_weight_update_seconds = None
        self.compilations_at_warmup = None
        # per step: where the time went and which compiled bucket ran (the scheduler's
        # metrics.steps hold what ran: rows, tokens, KV use, preemptions, prefix hits)
        self.step_timings: list[StepTiming] = []
        self._overlap = config.async_scheduling
        self._in_flight: _InFlight | None = None   # the step left running (async scheduling)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """vLLM's spelling: `LLMEngine.from_engine_args(EngineArgs(model=..., **kwargs))`."""
        return cls(engine_args.model, **engine_args.kwargs)

    def _default_num_blocks(self, params) -> int:
        """CPU: room for every seat at max_model_len. GPU/TPU: gpu_memory_utilization of the
        device memory, less the weights, as vLLM sizes it."""
        cfg, mc = self.config, self.model_config
        # per device: with tensor_parallel_size N each device holds num_kv_heads / N of every block
        tp = cfg.tensor_parallel_size
        kv_itemsize = self.dtype.itemsize if cfg.kv_cache_dtype == "auto" else np.dtype(jnp.dtype(cfg.kv_cache_dtype)).itemsize
        per_block = 2 * mc.num_layers * (mc.num_kv_heads // tp) * cfg.block_size * mc.head_dim * kv_itemsize
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
        """Accept a request (refused at once with ValueError if it could never run). The engine
        keeps a copy of `params`: changing them afterwards changes later requests only."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        groups = self.output_processor.groups
        if request_id is None:  # the next number no live request already uses as its id
            while str(self._counter) in groups or str(self._counter) in self.scheduler.requests:
                self._counter += 1
            request_id = str(self._counter)
            self._counter += 1
        request_id = str(request_id)
        if request_id in groups:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        params = params.clone()
        text, ids = self._tokenize(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids must be ints in [0, vocab_size={vocab}); got {bad[:5]}")
        for name, toks in (("allowed_token_ids", params.allowed_token_ids), ("logit_bias", params.logit_bias)):
            out_of_vocab = sorted(t for t in toks or () if not 0 <= t < vocab)
            if out_of_vocab:
                raise ValueError(f"{name} has token ids out of vocabulary (size {vocab}): {out_of_vocab[:5]}")
        keep = params.truncate_prompt_tokens
        if keep is not None:  # the last k tokens (-1: as many as leave room for one token)
            ids = ids[-(self.config.max_model_len - 1 if keep == -1 else keep):]
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer and the model has none: use stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and (k == -1 or k > self.max_logprobs):
                raise ValueError(f"{name} ({'-1: every token' if k == -1 else k}) exceeds max_logprobs "
                                 f"({self.max_logprobs})")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        eos = None if not self.eos_token_ids else min(self.eos_token_ids)
        if len(self.eos_token_ids) > 1 and not params.ignore_eos:  # the model's other end tokens stop it too
            params.stop_token_ids = list(params.stop_token_ids or []) + sorted(self.eos_token_ids - {eos})
        req = Request(request_id, [int(t) for t in ids], params,
                      arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
                      eos_token_id=eos, seed=seed, bad_words_token_ids=self._bad_words(params.bad_words))
        self.scheduler.add_request(req)  # validates lengths against max_model_len and the pool
        self.output_processor.add(request_id, text, req.prompt_token_ids, params, req)
        return request_id

    def _bad_words(self, words: list[str] | None) -> list[list[int]] | None:
        """Each bad word's token ids as vLLM finds them: the word alone, and with a leading space
        when that tokenizes to a different first token of the same length (a word mid-text)."""
        if not words:
            return None
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer and the model has none: use logit_bias or "
                             "allowed_token_ids")
        out = []
        for word in words:
            alone = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            out += [alone] if alone else []
            if spaced and (not alone or (spaced[0] != alone[0] and len(spaced) == len(alone))):
                out.append(spaced)
        vocab = self.model_config.vocab_size
        invalid = sorted({t for w in out for t in w if not 0 <= t < vocab})
        if invalid:
            raise ValueError(f"The model vocabulary size is {vocab}, but the following tokens were specified as "
                             f"bad: {invalid}. All token id values should be integers satisfying: "
                             f"0 <= token_id < {vocab}.")
        return out

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt: a string, token ids, a TextPrompt
        ({"prompt": str}) or a TokensPrompt ({"prompt_token_ids": [...]}) (pagedjax.inputs)."""
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "add_special_tokens", "cache_salt"})
            if unknown:
                raise ValueError(f"prompt dict has unsupported keys {unknown}: a TextPrompt has 'prompt', a "
                                 "TokensPrompt 'prompt_token_ids' (multi-modal inputs are not supported)")
            if "prompt_token_ids" in prompt:
                ids = list(prompt["prompt_token_ids"])
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                return self._encode(prompt["prompt"], prompt.get("add_special_tokens", True))
            else:
                raise ValueError("a dict prompt needs 'prompt_token_ids' (TokensPrompt) or 'prompt' (TextPrompt)")
        elif isinstance(prompt, str):
            return self._encode(prompt, True)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids, text = list(prompt), None
        else:
            raise ValueError(f"prompt must be a string, a token id list or a dict, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt_token_ids is empty: it must contain at least 1 token")
        return text, ids

    def _encode(self, text, add_special_tokens: bool) -> tuple[str, list[int]]:
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a string, got {type(text).__name__}")
        if self.tokenizer is None:
            raise ValueError("prompt is a string but the model has no tokenizer: pass "
                             "{'prompt_token_ids': [...]} instead")
        ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if not ids:
            raise ValueError("prompt is empty: it must contain at least 1 token")
        return text, ids

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (one id or several) and every sample of them, from any state; their
        blocks return at once. Ids of requests that finished already, or never were, are ignored,
        as vLLM does."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            group = self.output_processor.pop(str(rid))
            for req in group.members.values() if group is not None else ():
                if not req.is_finished:
                    self.scheduler.abort_request(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.groups)

    # -- one step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run and apply one step; returns an output for every request that progressed.

        With `async_scheduling`, the step scheduled here is left running on the device and the
        one before it is taken back: the host schedules and packs step N+1 while step N runs,
        N+1 reading N's sampled tokens on the device, and each step's outputs come one call
        later. Steps whose rows need their tokens on the host first (logits processors, prompt
        logprobs, a beam search) run synchronously.

        If the device step raises when started, it is rolled back on the host before the exception
        propagates: no token is appended, the blocks allocated for it stay with their requests
        (their content is recomputed next time), and the engine stays usable. If fetching its
        results raises, the requests of the lost steps are recomputed from their last good token."""
        prev, self._in_flight = self._in_flight, None
        overlap = self._overlap and not any(r.sampling_params.uses_logits_processors or r.skip_prefix_cache
                                            for r in self.scheduler.requests.values())
        outputs = []
        if prev is not None and not overlap:
            outputs, prev = self._finish(prev), None
        try:
            cur = self._launch(prev)
        except BaseException:
            self._in_flight = prev
            raise
        if prev is not None:
            outputs = self._finish(prev, also_lost=cur)
        if cur is not None and overlap:
            self._in_flight = cur
        elif cur is not None:
            outputs += self._finish(cur)
        return outputs

    def _launch(self, prev: _InFlight | None) -> _InFlight | None:
        """Schedule a step, pack it and start it on the device (reading prev's tokens there)."""
        sched = self.scheduler
        t0 = time.perf_counter()
        out = sched.schedule()
        if out.is_empty:
            self.step_timings.append(StepTiming(out.step, None, time.perf_counter() - t0, start=t0))
            return None
        t1 = time.perf_counter()
        step = self.packer.pack(out, sched.kv)
        t2 = time.perf_counter()
        procs = self.logits_packer.pack(out, step.bucket[1])
        try:
            handle = self.runner.dispatch(out, step, procs, feed=None if prev is None else prev.handle)
        except BaseException:
            sched.rollback_step(out)
            raise
        if any(r.skip_prefix_cache for r in out.scheduled):
            self._record_prompt_logprobs(out, step.bucket[0])
        shape = step_shape(out, step, self.config.block_size)
        sched.advance(out)
        return _InFlight(out, handle, StepTiming(out.step, step.bucket, t1 - t0, t2 - t1,
                                                 time.perf_counter() - t2, shape=shape, start=t0))

    def _finish(self, f: _InFlight, also_lost: _InFlight | None = None) -> list[RequestOutput]:
        """Wait for a launched step, put its tokens in place and turn them into outputs. If its
        results are lost, its requests (and those of `also_lost`, which read its tokens) are
        preempted to be recomputed, and the error propagates."""
        sched, timing = self.scheduler, f.timing
        t3 = time.perf_counter()
        try:
            tokens, logprob, rank, top_ids, top_lps, errors = self.runner.fetch(f.handle)
        except BaseException:
            for lost in (f, also_lost):
                for req in (lost.out.scheduled if lost is not None else ()):
                    if req.request_id in sched.requests:
                        sched.recompute_request(req.request_id)
            raise
        t4 = time.perf_counter()
        lps = None
        if any(r.sampling_params.logprobs is not None for r in f.out.scheduled):
            lps = [(float(logprob[i]), top_ids[i].tolist(), top_lps[i].tolist(), int(rank[i]))
                   for i in range(f.out.num_rows)]
        changed = sched.resolve(f.out, tokens, logprobs=lps, errors=errors)
        t5 = time.perf_counter()
        outputs = self.output_processor.process(
            changed, lambda rid: sched.finish_request(rid, RequestStatus.FINISHED_STOPPED))
        timing.execute += t4 - t3
        timing.update, timing.outputs = t5 - t4, time.perf_counter() - t5
        self.step_timings.append(timing)
        return outputs

    @property
    def step_in_flight(self) -> bool:
        """A step is running on the device whose tokens the next `step()` takes back (async scheduling)."""
        return self._in_flight is not None

    @contextlib.contextmanager
    def synchronous(self):
        """Inside: every step's tokens are back before the next step is scheduled (a caller that
        changes tokens between steps, as a beam search does, needs this under async scheduling)."""
        saved, self._overlap = self._overlap, False
        try:
            yield self
        finally:
            self._overlap = saved

    def _record_prompt_logprobs(self, out, T: int) -> None:
        """Append to each prefilling request that asks for prompt logprobs those of the prompt
        tokens this step's chunk predicts: the token after each computed position, up to the end of
        the prompt. A recomputed prompt (after preemption) records nothing twice."""
        targets = np.zeros(T, np.int32)
        rows, q = [], 0
        for req, n in zip(out.scheduled, out.num_new_tokens):
            start = req.num_computed_tokens
            first = max(start, len(req.prompt_logprobs))   # position predicting prompt token first + 1
            last = min(start + n, req.num_prompt_tokens - 1)
            if req.skip_prefix_cache and first < last:
                targets[q + first - start:q + last - start] = req.prompt_token_ids[first + 1:last + 1]
                rows.append((req, q + first - start, last - first))
            q += n
        if rows:
            logprob, rank, top_ids, top_lps = self.runner.prompt_logprobs(targets)
            for req, i, count in rows:
                req.prompt_logprobs += [(float(logprob[j]), top_ids[j].tolist(), top_lps[j].tolist(), int(rank[j]))
                                        for j in range(i, i + count)]

    # -- weights -----------------------------------------------------------------------------------
    @property
    def params(self):
        """The weights the step runs with, in the model's layout (a pytree of jax arrays; a stacked
        copy on the native CPU path, whose step reads them unstacked; see `update_weights`)."""
        return self.runner.params

    def update_weights(self, params, *, abort: bool = False, wait: bool = False, copy: bool = True
                       ) -> list[RequestOutput]:
        """Run from now on with `params` (the loaded model's tree, shapes, dtypes and shardings;
        checked leaf by leaf), without compiling anything: the step takes the weights as an
        argument. The prefix cache is emptied, so no block computed with the old weights is ever
        hit again. Unfinished requests would mix old and new weights: abort=True aborts them,
        wait=True runs them to completion first (their outputs are returned); otherwise this
        raises RuntimeError and changes nothing. copy: see ModelRunner.set_params (False: no
        device copy, the caller's arrays are used as they are)."""
        outputs: list[RequestOutput] = []
        if self.has_unfinished_requests():
            if abort:
                self.abort_request(list(self.output_processor.groups))
            elif wait:
                while self.has_unfinished_requests():
                    outputs += self.step()
            else:
                raise RuntimeError(f"update_weights: {self.get_num_unfinished_requests()} request(s) are unfinished; "
                                   "pass abort=True to abort them or wait=True to finish them first")
        self.last_weight_update_seconds = self.runner.set_params(params, copy=copy)
        if not self.scheduler.kv.reset_prefix_cache():
            raise RuntimeError("update_weights: the prefix cache could not be reset while blocks are held")
        self.weights_version += 1
        return outputs

    # -- warm-up and stats -----------------------------------------------------------------------
    def buckets(self) -> list[tuple[int, int, int]]:
        """Every (T, S, P) shape the packer can produce (S follows T: see BatchPacker)."""
        cfg = self.config
        return sorted({(T, self.packer.rows_for(T), P) for T in cfg.token_buckets for P in cfg.page_buckets})

    def warmup(self) -> float:
        """Compile every bucket now, so no request ever waits for a compilation."""
        dt = self.runner.warmup(self.buckets(), max_model_len=self.config.max_model_len)
        self.warmup_seconds = dt
        self.compilations_at_warmup = self.runner.num_compilations
        return dt

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

