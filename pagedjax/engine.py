"""LLMEngine: vLLM's engine loop over the scheduler, the packer and the runner.

One request's path: `LLM.generate` (pagedjax.llm) -> `LLMEngine.add_request` (tokenize, validate,
seed) -> `Scheduler.add_request`; then each `LLMEngine.step()`: `Scheduler.schedule()` decides the
step, `BatchPacker.pack()` fills the fixed-shape StepInput, `ModelRunner.execute()` runs the
jitted step (model, attention, sampling), `Scheduler.update_from_output()` appends the sampled
tokens, finishes requests and frees their blocks, and the engine turns them into
`RequestOutput`s (pagedjax.outputs).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.attention import resolve_backend
from pagedjax.config import EngineConfig
from pagedjax.metrics import StepTiming
from pagedjax.model.hub import LoadedModel, load_any_model
from pagedjax.outputs import CompletionOutput, RequestOutput, format_logprobs
from pagedjax.pallas.common import check_supported, device_limits
from pagedjax.parallel import check_tensor_parallel, param_bytes_per_device
from pagedjax.runner import ModelRunner
from pagedjax.sampling_params import SamplingParams
from pagedjax.scheduler.batch import BatchPacker
from pagedjax.scheduler.scheduler import Scheduler
from pagedjax.scheduler.sequence import Request, RequestStatus

logger = logging.getLogger(__name__)


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
        # per step: where the time went and which compiled bucket ran (the scheduler's
        # metrics.steps hold what ran: rows, tokens, KV use, preemptions, prefix hits)
        self.step_timings: list[StepTiming] = []

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

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (one id or several) and every sample of them, from any state; their
        blocks return at once. Ids of requests that finished already, or never were, are ignored,
        as vLLM does."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            group = self._groups.pop(str(rid), None)
            for req in group.members.values() if group is not None else ():
                if not req.is_finished:
                    self.scheduler.abort_request(req.request_id)

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
        t0 = time.perf_counter()
        out = sched.schedule()
        if out.is_empty:
            self.step_timings.append(StepTiming(out.step, None, time.perf_counter() - t0))
            return []
        t1 = time.perf_counter()
        step = self.packer.pack(out, sched.kv)
        t2 = time.perf_counter()
        try:
            tokens, logprob, top_ids, top_lps, errors = self.runner.execute(out, step)
        except BaseException:
            self.scheduler.rollback_step(out)
            raise
        t3 = time.perf_counter()
        lps = None
        if any(r.sampling_params.logprobs is not None for r in out.scheduled):
            lps = [(float(logprob[i]), top_ids[i].tolist(), top_lps[i].tolist()) for i in range(out.num_rows)]
        changed = sched.update_from_output(out, tokens, logprobs=lps, errors=errors)
        t4 = time.perf_counter()
        outputs = self._outputs(changed)
        self.step_timings.append(StepTiming(out.step, step.bucket, t1 - t0, t2 - t1, t3 - t2, t4 - t3,
                                            time.perf_counter() - t4))
        return outputs

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
                                            format_logprobs(m.output_token_ids, lp, group.params.logprobs),
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
