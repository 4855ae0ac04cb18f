"""The device side: the KV cache, one jitted step per shape bucket, and the block copies.

    step(params, kv_cache, StepInput) -> (greedy ids, logprobs, finite), logits, kv_cache, hidden

compiled once per bucket (T tokens, S rows, P block-table columns) with the cache donated, so
the new K/V are written in place. Small jitted calls follow it only in the steps that need them:
`resample_step` (a row samples), `process_step` (a row uses logits processors), `top_logprobs_step`
and `prompt_logprobs_step` (a row asks for top logprobs, of its output or of its prompt). Which
requests run only changes the inputs' values: after `warmup()` has compiled every bucket, requests
joining and leaving never compile again (`num_compilations` counts every trace in the process).

The model's attention is one backend object of pagedjax.attention ("pallas", "native",
"reference", "jnp"; "auto" resolved there), a static argument of the step.
Copy-on-write copies, swap-out and swap-in move whole blocks with small jitted functions over
padded index arrays (padding copies the null block onto itself).

Tensor parallelism (`config.tensor_parallel_size` N > 1, see pagedjax/parallel.py): params and the
pool are placed with their NamedShardings on a ("dp", "tp") mesh, the step inputs replicated; the
same jitted functions run, with `mesh` as a static argument that pins the pool's and the logits'
shardings (the Pallas backend holds the mesh too and runs its kernel under shard_map). N = 1 takes exactly the unsharded path.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax import native, parallel
from pagedjax.attention import init_kv_cache, make_attention, resolve_backend
from pagedjax.config import EngineConfig
from pagedjax.logits_processors import apply_logits_processors
from pagedjax.model.llama import ModelConfig, compute_logits, forward
from pagedjax.model.step_weights import StepWeights
from pagedjax.model.weights import check_params_like
from pagedjax.pallas.common import DeviceLimits, device_limits
from pagedjax.sampling import finite_greedy, logprob_and_rank, resample, sample_processed
from pagedjax.scheduler.batch import SamplingInputs, StepInput, step_fields
from pagedjax.scheduler.logits_inputs import LogitsInputs
from pagedjax.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)

# The step's inputs are plain dataclasses of numpy arrays on the host (no JAX there); the jitted
# step takes them as they are.
for _cls in (StepInput, SamplingInputs, LogitsInputs):
    jax.tree_util.register_dataclass(_cls, data_fields=step_fields(_cls), meta_fields=[])

COPY_BUCKETS = (8, 64, 512)


class _Counter:
    """Compilations in this process: every trace of a jitted function below adds one. Engines with
    the same model and shapes share compilations (the jitted functions are module-level), so
    count differences, not totals."""

    value = 0


def _trace():
    _Counter.value += 1


def _keep_pool_sharding(kv_cache, mesh):
    # The donated pool must come out with the sharding it went in with: otherwise its buffers
    # cannot be reused in place and the next step sees a new input sharding (a recompilation).
    if mesh is None:
        return kv_cache
    return jax.lax.with_sharding_constraint(kv_cache, (parallel.kv_sharding(mesh),) * len(kv_cache))


@functools.partial(jax.jit, static_argnames=("cfg", "attention", "logits_hook", "mesh", "unroll", "native_greedy"),
                   donate_argnums=(1,))
def _step_fn(params, kv_cache, step: StepInput, *, cfg, attention, logits_hook, mesh=None, unroll=False,
             native_greedy=False):
    _trace()
    # tokens the previous step sampled, which the host did not have when it packed this one
    token_ids = jnp.where(step.token_source >= 0, step.prev_tokens[jnp.maximum(step.token_source, 0)], step.token_ids)
    hidden, kv_cache = forward(params, cfg, token_ids, step.positions, kv_cache, step.attention, attention,
                               unroll=unroll)
    kv_cache = _keep_pool_sharding(kv_cache, mesh)
    logits = compute_logits(params, cfg, hidden[step.logits_indices])
    if mesh is not None:  # gathered: every device samples the same whole rows
        logits = jax.lax.with_sharding_constraint(logits, parallel.replicated(mesh))
    if logits_hook is not None:
        logits = logits_hook(logits, step)
    safe, finite, (tokens, logprob, lse, top_ids, top_lps) = finite_greedy(logits, native_kernel=native_greedy)
    # the (masked) logits stay on the device for `resample_step`, `process_step` and
    # `top_logprobs_step`, which run only when a row samples, uses logits processors or asks for
    # top logprobs, and the hidden states for `prompt_logprobs_step`; a greedy token's rank is 1
    # (the first of the highest logits); the top ids and logprobs are empty ([S, 0])
    return (tokens, logprob, jnp.ones_like(tokens), top_ids, top_lps, finite), (safe, lse), kv_cache, hidden


@jax.jit
def resample_step(safe, lse, tokens, sampling: SamplingInputs):
    """(tokens, logprobs) after sampling: the step's rows with temperature > 0 sampled from its
    logits (non-finite rows already zeroed by the step; the others keep their greedy token): a
    second call, because inside the step it cost every step ~5 ms (see `pagedjax.sampling.sample`).
    One compilation per row bucket S."""
    _trace()
    s = sampling
    return resample(safe, lse, tokens, s.temperature, s.top_k, s.top_p, s.min_p, s.seeds, s.sample_positions)


@functools.partial(jax.jit, static_argnames=("random",))
def process_step(safe, lse, sampling: SamplingInputs, procs: LogitsInputs, *, random: bool):
    """(tokens, logprobs, ranks) of a step in which some row uses logits processors (penalties,
    logit_bias, allowed_token_ids, bad_words, min_tokens): its logits processed, then every row
    greedy or sampled (random: some row samples). Logprobs and ranks are the raw model's. A call
    of its own, like `resample_step`, so a step without processors pays nothing for them; one
    compilation per row bucket S and value of `random`."""
    _trace()
    s = sampling
    logits = apply_logits_processors(safe, procs)
    return sample_processed(logits, safe, lse, s.temperature, s.top_k, s.top_p, s.min_p, s.seeds,
                            s.sample_positions, random=random)


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def top_logprobs_step(safe, lse, *, num_logprobs):
    """(top ids int32[S, K], their logprobs f32[S, K]) of the step's logits, K = num_logprobs: a
    call of its own, run only in steps where some row asks for top logprobs; inside the step, the
    top-k over the whole [S, V] log-softmax doubled the cost of choosing the greedy tokens (32 rows
    of SmolLM2's 49,152-token vocabulary on a 2-core CPU: 12.9 ms instead of 6.6). One compilation
    per row bucket S."""
    _trace()
    top_lps, top_ids = jax.lax.top_k(safe - lse[:, None], num_logprobs)
    return top_ids.astype(jnp.int32), top_lps


@functools.partial(jax.jit, static_argnames=("cfg", "num_logprobs"))
def prompt_logprobs_step(params, hidden, targets, *, cfg, num_logprobs):
    """Log-probabilities of prompt tokens from a step's hidden states f32[T, H]: at each token,
    the logprob and rank of targets[t] (the prompt token that follows it) and the top
    `num_logprobs`. Runs only for steps that prefill a request asking for prompt_logprobs; one
    compilation per token bucket T."""
    _trace()
    logits = compute_logits(params, cfg, hidden)
    lse = jax.nn.logsumexp(logits, axis=-1)
    logprob, rank = logprob_and_rank(logits, lse, targets)
    top_lps, top_ids = jax.lax.top_k(logits - lse[:, None], num_logprobs)
    return logprob, rank, top_ids.astype(jnp.int32), top_lps


@functools.partial(jax.jit, static_argnames=("rows",))
def _feed_fn(tokens, *, rows):
    """A step's sampled tokens int32[S] as the next step's prev_tokens int32[rows] (one shape for
    every S, so the step compiles once per bucket). One compilation per row bucket S."""
    _trace()
    return jnp.zeros(rows, jnp.int32).at[:tokens.shape[0]].set(tokens)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnums=(0,))
def _copy_fn(kv_cache, pairs, *, mesh=None):
    _trace()
    src, dst = pairs[:, 0], pairs[:, 1]
    return _keep_pool_sharding(tuple(c.at[:, :, dst].set(c[:, :, src]) for c in kv_cache), mesh)


@jax.jit
def _gather_fn(kv_cache, ids):
    _trace()
    return tuple(c[:, :, ids] for c in kv_cache)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnums=(0,))
def _scatter_fn(kv_cache, ids, blocks, *, mesh=None):
    _trace()
    return _keep_pool_sharding(tuple(c.at[:, :, ids].set(b) for c, b in zip(kv_cache, blocks)), mesh)


def make_step(cfg: ModelConfig, *, backend: str, logits_hook=None, mesh=None, limits: DeviceLimits | None = None,
              unroll: bool = False):
    """The jitted step `ModelRunner` runs: step(params, kv_cache, inputs) -> (results, logits,
    kv_cache), the cache donated. `limits` describes the device the Pallas kernels are tiled and
    compiled for (default: the local one); `pagedjax.aot` passes a named TPU's or GPU's to compile
    the step for it from a CPU. unroll: the layers without a loop (see `forward`)."""
    attention = make_attention(backend, limits=limits or device_limits(), mesh=mesh)
    native_greedy = backend == "native" and mesh is None and native.greedy_available()
    return functools.partial(_step_fn, cfg=cfg, attention=attention, logits_hook=logits_hook, mesh=mesh,
                             unroll=unroll, native_greedy=native_greedy)


@dataclasses.dataclass
class Dispatched:
    """A step started on the device: its results (device arrays, not waited for) and real rows."""

    results: tuple
    num_rows: int


class ModelRunner:
    def __init__(self, model_config: ModelConfig, params: Any, config: EngineConfig, num_blocks: int,
                 *, num_host_blocks: int = 0, kv_dtype: Any = None, num_logprobs: int = 0,
                 logits_hook=None):
        self.cfg = model_config
        self.config = config
        self.num_blocks = num_blocks
        self.backend = resolve_backend(config.attention_backend, config.tensor_parallel_size)
        self.num_logprobs = num_logprobs
        self._prompt_step = functools.partial(prompt_logprobs_step, cfg=model_config, num_logprobs=max(num_logprobs, 1))
        self.kv_dtype = kv_dtype or jax.tree.leaves(params)[0].dtype
        self.tensor_parallel_size = tp = config.tensor_parallel_size
        parallel.check_tensor_parallel(tp, model_config)
        self.mesh = None
        if tp == 1:
            # the values' dtype, or how the backend stores them (a bfloat16 pool as uint16 bits: native)
            self.kv_storage_dtype = make_attention(self.backend).pool_dtype(self.kv_dtype)
            self.kv_cache = init_kv_cache(model_config, num_blocks, config.block_size, self.kv_storage_dtype)
        else:
            self.kv_storage_dtype = self.kv_dtype
            self.mesh = parallel.make_mesh(tp)
            params = parallel.shard_params(params, self.mesh)
            self.kv_cache = parallel.init_sharded_kv_cache(model_config, self.mesh, num_blocks, config.block_size,
                                                           self.kv_dtype)
        # the weights as the step reads them: on the native CPU path unstacked, and the projections
        # as the native matmul's panels (pagedjax.model.step_weights); `params` gives them back in
        # the model's layout, checked against what was loaded
        self.weights = StepWeights(params, unstacked=tp == 1 and make_attention(self.backend).unstacked_layers)
        self.loaded = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), params)
        # each device holds 1/N of the pool: the same per-device budget holds N times the tokens
        self.kv_bytes_per_device = parallel.kv_bytes_per_device(model_config, num_blocks, config.block_size,
                                                                self.kv_dtype, tp)
        logger.info("KV pool: %d blocks of %d tokens, %.1f MiB per device on %d device(s)", num_blocks,
                    config.block_size, self.kv_bytes_per_device / 2**20, tp)
        shape = (model_config.num_layers, model_config.num_kv_heads, num_host_blocks, config.block_size,
                 model_config.head_dim)
        self.host_cache = (np.zeros(shape, self.kv_storage_dtype), np.zeros(shape, self.kv_storage_dtype)) \
            if num_host_blocks else None
        # tests use it to make chosen rows' logits non-finite: (logits, StepInput) -> logits
        self.logits_hook = logits_hook
        self.compile_seconds = 0.0
        self.last_hidden = None   # the last step's hidden states, for prompt logprobs
        self._no_feed: dict[int, jax.Array] = {}   # prev_tokens of a step fed by none
        self._compiled: dict[Any, Any] = {}   # compiled ahead of time: the step by (T, S, P), prompt logprobs by T
        self._step = make_step(model_config, backend=self.backend, logits_hook=logits_hook, mesh=self.mesh)
        self._copy, self._gather, self._scatter = _copy_fn, _gather_fn, _scatter_fn
        if self.mesh is not None:
            self._copy = functools.partial(_copy_fn, mesh=self.mesh)
            self._scatter = functools.partial(_scatter_fn, mesh=self.mesh)

    @property
    def step_params(self) -> Any:
        """The weights as the step reads them (pagedjax.model.step_weights)."""
        return self.weights.arrays

    @property
    def params(self) -> Any:
        """The weights in the model's layout (pagedjax.model.llama); a copy where the step holds
        them otherwise (the native CPU path)."""
        return self.weights.params

    def set_params(self, params: Any, copy: bool = True) -> float:
        """Replace the weights by `params` of the same tree structure, shapes and dtypes (and, for
        jax arrays, shardings) as the loaded ones, refused with ValueError naming the first leaf
        that differs. The step takes the weights as an argument, so nothing compiles (but see the
        comment below on packed weights). copy=True: the engine keeps a copy, so the caller may donate or
        overwrite its own arrays afterwards; copy=False: it holds the caller's device arrays as
        they are (no copy; they must then stay alive and unchanged), except where the step reads
        them otherwise (the native CPU path), which copies them. Host arrays are placed with the
        loaded model's shardings either way. Returns seconds spent."""
        t0 = time.perf_counter()
        check_params_like(params, self.loaded)
        params = jax.tree.map(lambda new, old: jax.device_put(new, old.sharding, may_alias=False if copy else None),
                              params, self.loaded)
        before = jax.tree.structure(self.step_params)
        self.weights.replace(params)
        if jax.tree.structure(self.step_params) != before:
            # held in another form (a packed checkpoint's weights moved off its 4-bit values): the
            # programs compiled for the old form cannot take them; each bucket compiles once more
            logger.warning("set_params: the weights left their packed form; the step compiles again")
            self._compiled.clear()
        jax.block_until_ready(self.step_params)
        return time.perf_counter() - t0

    def _inputs(self, step, prev_tokens=None):
        """Step inputs, replicated on the mesh (one block table serves every shard). A StepInput's
        prev_tokens always travel as a device array (one compiled program for both kinds of
        step): the previous step's sampled tokens, or zeros."""
        if isinstance(step, StepInput):
            rows = step.prev_tokens.shape[0]
            if prev_tokens is not None:
                step.prev_tokens = _feed_fn(prev_tokens, rows=rows)
            else:
                zeros = self._no_feed.get(rows)
                step.prev_tokens = self._no_feed[rows] = jnp.zeros(rows, jnp.int32) if zeros is None else zeros
        if self.mesh is None:
            return step
        return jax.device_put(step, parallel.replicated(self.mesh))

    @property
    def num_compilations(self) -> int:
        """Compilations in this process so far (shared by engines of the same model and shapes)."""
        return _Counter.value

    def execute(self, out: SchedulerOutput, step: StepInput, procs: LogitsInputs | None = None):
        """Run one step and wait for it: `fetch(dispatch(...))`."""
        return self.fetch(self.dispatch(out, step, procs))

    def dispatch(self, out: SchedulerOutput, step: StepInput, procs: LogitsInputs | None = None,
                 feed: Dispatched | None = None) -> Dispatched:
        """Apply the step's swaps and copies and start it on the device, without waiting for it
        (JAX dispatches asynchronously); `fetch` waits for its results. procs: the rows'
        logits-processor inputs, None when no row uses one. feed: the step dispatched before
        this one, whose sampled tokens replace the tokens marked in step.token_source."""
        if out.swap_out:
            self.swap_out(out.swap_out)
        if out.swap_in:
            self.swap_in(out.swap_in)
        if out.block_copies:
            self.copy_blocks(out.block_copies)
        host = step.copy()  # the packer rewrites its buffers next step
        n_before = self.num_compilations
        t0 = time.perf_counter()
        inputs = self._inputs(host, None if feed is None else feed.results[0])
        step_fn = self._compiled.get(host.bucket, self._step)
        results, logits, self.kv_cache, self.last_hidden = step_fn(self.step_params, self.kv_cache, inputs)
        random = bool(np.any(host.sampling.temperature > 0))
        if procs is not None:
            results = self._process(results, logits, inputs, self._inputs(procs), random)
        elif random:
            results = self._resample(results, logits, inputs)
        if self.num_logprobs and any((r.sampling_params.logprobs or 0) > 0 for r in out.scheduled):
            results = self._top_logprobs(results, logits)
        if out.block_copies_after:
            # contiguous forks copy blocks the step itself has just filled
            self.copy_blocks(out.block_copies_after)
        if self.num_compilations != n_before:
            self.compile_seconds += time.perf_counter() - t0
            logger.info("compiled the step for bucket %s (%d compilations so far)", step.bucket, self.num_compilations)
        return Dispatched(results, out.num_rows)

    @staticmethod
    def fetch(d: Dispatched):
        """Wait for a dispatched step; host arrays (sampled int32[R], logprob f32[R], rank int32[R],
        top ids [R, K], top logprobs [R, K], errors bool[R]) of its R rows."""
        tokens, logprob, rank, top_ids, top_lps, finite = jax.device_get(d.results)
        R = d.num_rows
        return tokens[:R], logprob[:R], rank[:R], top_ids[:R], top_lps[:R], ~finite[:R]

    @staticmethod
    def _resample(results, logits, inputs):
        tokens, logprob, rank, top_ids, top_lps, finite = results
        tokens, logprob, rank = resample_step(*logits, tokens, inputs.sampling)
        return tokens, logprob, rank, top_ids, top_lps, finite

    @staticmethod
    def _process(results, logits, inputs, procs, random):
        tokens, logprob, rank, top_ids, top_lps, finite = results
        tokens, logprob, rank = process_step(*logits, inputs.sampling, procs, random=random)
        return tokens, logprob, rank, top_ids, top_lps, finite

    def _top_logprobs(self, results, logits):
        return results[:3] + top_logprobs_step(*logits, num_logprobs=self.num_logprobs) + results[5:]

    def prompt_logprobs(self, targets: np.ndarray):
        """Host arrays (logprob f32[T], rank int32[T], top ids [T, K], top logprobs [T, K]) of
        targets int32[T] at every token of the last step (see `prompt_logprobs_step`)."""
        return jax.device_get(self._prompt_logprobs(self.last_hidden, targets))

    def _prompt_logprobs(self, hidden, targets):
        step = self._compiled.get(hidden.shape[0], self._prompt_step)   # compiled at warm-up, by T
        return step(self.step_params, hidden, targets)

    # -- block moves -----------------------------------------------------------------------------
    @staticmethod
    def _pad_pairs(pairs):
        n = len(pairs)
        C = next((b for b in COPY_BUCKETS if b >= n), n)
        arr = np.zeros((C, 2), np.int32)
        arr[:n] = pairs
        return arr

    def copy_blocks(self, pairs):
        self.kv_cache = self._copy(self.kv_cache, self._pad_pairs(pairs))

    def swap_out(self, pairs):
        """(device block, host block) pairs: device -> host."""
        padded = self._pad_pairs(pairs)
        blocks = jax.device_get(self._gather(self.kv_cache, padded[:, 0]))
        host = np.asarray([h for _, h in pairs])
        for hc, b in zip(self.host_cache, blocks):
            hc[:, :, host] = b[:, :, :len(pairs)]

    def swap_in(self, pairs):
        """(host block, device block) pairs: host -> device. Padding rows write zeros into the
        null block, which only padding ever reads."""
        padded = self._pad_pairs(pairs)
        host = np.asarray([h for h, _ in pairs])
        blocks = []
        for hc in self.host_cache:
            b = np.zeros(hc.shape[:2] + (len(padded),) + hc.shape[3:], hc.dtype)
            b[:, :, :len(pairs)] = hc[:, :, host]
            blocks.append(b)
        self.kv_cache = self._scatter(self.kv_cache, padded[:, 1], tuple(blocks))

    # -- warm-up -----------------------------------------------------------------------------------
    def warmup(self, buckets, *, with_copies: bool = True, max_model_len: int | None = None) -> float:
        """Compile every (T, S, P) bucket and the block-move functions; returns seconds spent.
        max_model_len: also compile the logits processors for each row bucket (their inputs hold
        max_model_len tokens per row)."""
        t0 = time.perf_counter()
        sampled_rows, prompt_rows = set(), set()
        for T, S, P in buckets:
            inputs = self._inputs(StepInput.padding(T, S, P, self.config.seq_buckets[-1]))
            if self.mesh is None:
                # compiled (or loaded from the persistent cache) without running it: running the
                # large buckets once costs seconds; the small calls below take zeros of its outputs
                compiled = self._step.func.lower(self.step_params, self.kv_cache, inputs, **self._step.keywords).compile()
                self._compiled[(T, S, P)] = compiled
                results, logits, _, hidden = compiled.out_info
                results, logits, hidden = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), (results, logits, hidden))
            else:
                results, logits, self.kv_cache, hidden = self._step(self.step_params, self.kv_cache, inputs)
            if T not in prompt_rows and max_model_len:  # prompt logprobs: once per token bucket
                prompt_rows.add(T)
                self._compiled[T] = self._prompt_step.func.lower(self.step_params, hidden, np.zeros(T, np.int32),
                                                                 **self._prompt_step.keywords).compile()
            if S not in sampled_rows:  # the sampler, the processors, the feed compile once per row bucket
                sampled_rows.add(S)
                jax.block_until_ready(_feed_fn(results[0], rows=self.config.seq_buckets[-1]))
                jax.block_until_ready(self._resample(results, logits, inputs))
                if self.num_logprobs:
                    jax.block_until_ready(self._top_logprobs(results, logits))
                if max_model_len:
                    procs = self._inputs(LogitsInputs.neutral(S, self.cfg.vocab_size, max_model_len))
                    for random in (False, True):
                        jax.block_until_ready(self._process(results, logits, inputs, procs, random))
            jax.block_until_ready(results)
        if with_copies:
            for C in COPY_BUCKETS:
                self.kv_cache = self._copy(self.kv_cache, np.zeros((C, 2), np.int32))
                if self.host_cache is not None:
                    jax.block_until_ready(self._gather(self.kv_cache, np.zeros(C, np.int32)))
                    zeros = tuple(np.zeros(hc.shape[:2] + (C,) + hc.shape[3:], hc.dtype) for hc in self.host_cache)
                    self.kv_cache = self._scatter(self.kv_cache, np.zeros(C, np.int32), zeros)
        jax.block_until_ready(self.kv_cache)
        dt = time.perf_counter() - t0
        self.compile_seconds += dt
        return dt
