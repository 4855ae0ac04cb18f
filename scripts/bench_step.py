"""What one decode step of the real model costs, against the matmuls it cannot avoid.

For each batch size B: B requests with ~`--context`-token prompts are prefilled, then `--steps`
decode steps are timed through the whole engine (schedule, pack, device step, sampling,
update). Beside it, in the same process, a jitted *matmul-only* step of the same model and
batch: embeddings, every projection, the MLP and the output head, no attention, no KV write,
no sampling, no host work. The ratio full / matmul-only says what attention, KV writes,
sampling and host work add on top of the unavoidable part. On the CPU path it also times the
jitted forward alone at the same batch and context, with and without the attention over the
cached context, to say how much of the difference that attention is; and where the step chooses
its greedy tokens with the native kernel, the device step alone with that kernel and with XLA's
ops, in turn.

    python scripts/bench_step.py [--model smollm2-135m] [--batch 1 8 32 64] [--context 200]

--processors also times, per batch size and in turn, the same decode step with vLLM's logits
processors off and on: "plain" (no row uses one: the engine checks and runs the step it always
ran), "no check" (the same, with the engine's per-step check for processors skipped: the cost of
having them at all), "penalties" (every row with repetition, frequency and presence penalties),
"all" (every row with the penalties, logit_bias, allowed_token_ids, bad_words and min_tokens), each
greedy, and "sampled" / "all, sampled" at temperature 0.8.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import random
import time

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.engine import LLMEngine
from pagedjax.runner import make_step
from pagedjax.scheduler.batch import StepInput
from pagedjax.scheduler.logits_inputs import LogitsPacker
from pagedjax.attention import Attention, AttentionMetadata, init_kv_cache, make_attention
from pagedjax.model.llama import attn_out_and_mlp, compute_logits, forward, layers_unstacked, linear, rms_norm
from pagedjax.sampling_params import SamplingParams
from pagedjax.scheduler.sequence import RequestStatus


def matmul_only_step(params, cfg, B: int):
    """Embeddings, q/k/v/o projections, MLP and head for B tokens; attention replaced by q, and
    no sampling: the logits are consumed by a row max, the cheapest reduction that keeps the
    head's matmul (an argmax would be sampling, and costs 3.6 ms at batch 32 in XLA on a CPU)."""

    @jax.jit
    def f(params, token_ids):
        x = params["embed_tokens"][token_ids]

        out_in = layers_unstacked(params)  # as the engine's step reads them (see unstack_layers)

        def layer(x, lp):
            h = rms_norm(x, lp["input_layernorm"], cfg.rms_norm_eps)
            q = linear(h, lp["q_proj"], lp, "q_bias", out_in=out_in)
            k = linear(h, lp["k_proj"], lp, "k_bias", out_in=out_in)
            v = linear(h, lp["v_proj"], lp, "v_bias", out_in=out_in)
            # keep k and v alive without attention: a negligible reduction
            o = q + (k.sum() + v.sum()) * 0
            return attn_out_and_mlp(cfg, lp, x, o, out_in=out_in), None

        if out_in:
            for lp in params["layers"]:
                x, _ = layer(x, lp)
        else:
            x, _ = jax.lax.scan(layer, x, params["layers"])
        return jnp.max(compute_logits(params, cfg, x), axis=-1)

    ids = jnp.zeros(B, jnp.int32)
    jax.block_until_ready(f(params, ids))
    return lambda: jax.block_until_ready(f(params, ids))


@dataclasses.dataclass(frozen=True)
class NoContext(Attention):
    """A CPU split backend that sees no cached context, as if every row were a fresh prompt."""

    inner: Attention

    @property
    def writes_kv(self):
        return self.inner.writes_kv

    def applies_rope(self, dtype):
        return self.inner.applies_rope(dtype)

    def plan(self, meta, num_tokens, rope=None):
        layout, *rest = self.inner.plan(meta, num_tokens, rope)
        return layout._replace(start=jnp.zeros_like(layout.start)), *rest

    def __call__(self, q, k, v, kv_cache, layer, plan):
        return self.inner(q, k, v, kv_cache, layer, plan)


def forward_step(params, cfg, B: int, context: int, block_size: int, pages: int, *, with_context: bool,
                 shuffled: bool = False, backend: str = "reference", kv_dtype=None):
    """The jitted CPU forward plus the head (logits consumed by a row max) for B decode tokens,
    each at position `context` - 1 of its own row in a random-content pool, cache donated; with
    `with_context=False` the attention over the cached context is skipped (the step's own K/V
    only, as if every row were a fresh prompt), so the difference of the two is what reading the
    context costs. `backend` is the CPU attention timed ("reference" or "native"); `kv_dtype` the
    pool's (default: the model's), held as the backend holds it (a native bf16 pool as its bits)."""
    rng = np.random.default_rng(0)
    n_pages = -(-context // block_size)
    num_blocks = B * n_pages + 1
    attention = make_attention(backend)
    kv_dtype = jnp.dtype(kv_dtype or params["embed_tokens"].dtype)
    storage = jnp.dtype(attention.pool_dtype(kv_dtype))
    kv = tuple(jax.lax.bitcast_convert_type(jnp.asarray(rng.standard_normal(c.shape, np.float32) * 0.1, kv_dtype),
                                            storage)
               for c in init_kv_cache(cfg, num_blocks, block_size, storage))
    tables = np.zeros((B, pages), np.int32)
    blocks = rng.permutation(B * n_pages) if shuffled else np.arange(B * n_pages)
    tables[:, :n_pages] = 1 + blocks.reshape(B, n_pages)
    last = context - 1
    attn = AttentionMetadata(jnp.asarray(tables[:, last // block_size] * block_size + last % block_size),
                             jnp.asarray(tables), jnp.full(B, context, jnp.int32),
                             jnp.arange(B + 1, dtype=jnp.int32), jnp.int32(B))
    ids, pos = jnp.zeros(B, jnp.int32), jnp.full(B, last, jnp.int32)

    attention = attention if with_context else NoContext(attention)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def f(params, kv, ids, pos, attn):
        h, kv = forward(params, cfg, ids, pos, kv, attn, attention)
        return jnp.max(compute_logits(params, cfg, h), axis=-1), kv

    state = {"kv": kv}

    def run():
        out, state["kv"] = f(params, state["kv"], ids, pos, attn)
        jax.block_until_ready(out)

    run()
    return run


def timed_in_turn(fns, n):
    """Median seconds of each of `fns`, called in turn n times, so drift hits them alike."""
    ts = [[] for _ in fns]
    for _ in range(n):
        for f, t in zip(fns, ts):
            t0 = time.perf_counter()
            f()
            t.append(time.perf_counter() - t0)
    return [float(np.median(t)) for t in ts]


PROCESSOR_VARIANTS = {
    "plain": {},
    "no check": {},
    "penalties": dict(repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2),
    "all": dict(repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2, logit_bias={7: 1.0, 9: -2.0},
                allowed_token_ids=True, min_tokens=4096, stop_token_ids=[0]),
    "sampled": dict(temperature=0.8, top_p=0.9),
    "all, sampled": dict(temperature=0.8, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.3,
                         presence_penalty=0.2, logit_bias={7: 1.0, 9: -2.0}, allowed_token_ids=True, min_tokens=4096, stop_token_ids=[0]),
}
PROCESSOR_ROUNDS, PROCESSOR_TIMED = 10, 4
PROCESSOR_STEPS = PROCESSOR_ROUNDS * (PROCESSOR_TIMED + 1) * len(PROCESSOR_VARIANTS)


def time_processors(eng, live, rounds=PROCESSOR_ROUNDS, steps=PROCESSOR_TIMED):
    """Median engine step (ms) with each of PROCESSOR_VARIANTS applied to every live request, the
    variants taken in turn, `steps` timed steps each after one untimed step, `rounds` times."""
    times = {name: [] for name in PROCESSOR_VARIANTS}
    V = eng.model_config.vocab_size
    allowed = list(range(V // 8, V // 2))  # "allowed_token_ids=True" below: half the vocabulary
    base = {r.request_id: r.sampling_params for r in live}
    for _ in range(rounds):
        for name, kw in PROCESSOR_VARIANTS.items():
            for r in live:
                kw = {**kw, "allowed_token_ids": allowed} if "allowed_token_ids" in kw else kw
                r.sampling_params = base[r.request_id].replace(**{"temperature": 0.0, **kw, "max_tokens": None})
                r.bad_words_token_ids = [[11, 12], [13]] if name.startswith("all") else None
            eng.logits_packer = LogitsPacker(eng.model_config.vocab_size, eng.config.max_model_len)
            if name == "no check":
                eng.logits_packer.pack = lambda out, S: None
            eng.step()  # untimed: the packer builds each row's state once
            for _ in range(steps):
                t0 = time.perf_counter()
                eng.step()
                times[name].append(time.perf_counter() - t0)
    eng.logits_packer = LogitsPacker(eng.model_config.vocab_size, eng.config.max_model_len)
    for r in live:
        r.sampling_params = base[r.request_id]
        r.bad_words_token_ids = None
    return {name: float(np.median(t)) * 1e3 for name, t in times.items()}


def time_device_steps(eng, B: int, n: int, steps):
    """Jitted steps of the engine's signature on the decode bucket of B rows (padding inputs, the
    logits of every row still computed and chosen from), timed in turn: ms each."""
    T = next(t for t in eng.config.token_buckets if t >= B)
    S = eng.packer.rows_for(T)
    P = max(eng.config.page_buckets)
    kv = {"pool": init_kv_cache(eng.model_config, 64, eng.config.block_size, eng.runner.kv_storage_dtype)}
    inputs = StepInput.padding(T, S, P)
    inputs.token_ids[:] = np.arange(T) % eng.model_config.vocab_size

    def runner(fn):
        def run():
            out = fn(eng.runner.step_params, kv["pool"], inputs)
            kv["pool"] = out[2]
            jax.block_until_ready(out[0])
        run()
        return run

    return [t * 1e3 for t in timed_in_turn([runner(fn) for fn in steps], n)]


def time_hidden_output(eng, B: int, n: int):
    """The device step as the engine runs it (returning the hidden states, for prompt logprobs)
    against the same step without that output (XLA drops what is not returned): (with, without) ms."""
    full = make_step(eng.model_config, backend=eng.backend)
    lean = jax.jit(lambda p, kv, x: full(p, kv, x)[:3], donate_argnums=(1,))
    return tuple(time_device_steps(eng, B, n, [full, lean]))


def time_greedy_choice(eng, B: int, n: int):
    """The device step with the greedy tokens chosen by the native kernel (pagedjax.native.greedy)
    against XLA's ops, in turn: (native, XLA) ms; None where the step does not use the kernel."""
    step = make_step(eng.model_config, backend=eng.backend)
    if not step.keywords.get("native_greedy"):
        return None
    xla = functools.partial(step.func, **{**step.keywords, "native_greedy": False})
    return tuple(time_device_steps(eng, B, n, [step, xla]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the KV pool's dtype: auto (the model's), bfloat16, ...")
    ap.add_argument("--processors", action="store_true", help="also time the logits processors off and on")
    ap.add_argument("--json", default="results/bench_step.json")
    args = ap.parse_args()
    rows = []
    max_b = max(args.batch)
    for name in ("context", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if min(args.batch) < 1:
        ap.error(f"--batch sizes must be >= 1, got {args.batch}")
    # buckets: each measured batch size is a token bucket of its own (no padded rows), 256-token
    # prefill chunks, and block tables up to 32 pages (512 tokens), or as many as a request can
    # reach: the first requests decode while the others prefill, then the timed steps
    budget = 256
    reach = (args.context + -(-max_b * args.context // budget) + args.steps + 16
             + (PROCESSOR_STEPS if args.processors else 0))
    max_model_len = max(512, -(-reach // 128) * 128)
    eng = LLMEngine(args.model, dtype=args.dtype, max_num_seqs=max_b, max_num_batched_tokens=budget,
                    max_model_len=max_model_len, attention_backend=args.attention_backend, enable_prefix_caching=False,
                    kv_cache_dtype=args.kv_cache_dtype,
                    token_buckets=tuple(sorted(set(args.batch) | {budget})), seq_buckets=tuple(sorted(set(args.batch))),
                    page_buckets=tuple(sorted({8, 16, 32, max_model_len // 16})))
    buckets = eng.buckets()
    warm = eng.warmup()
    print(f"{args.model}: {jax.devices()[0].platform}, backend {eng.backend}, {len(buckets)} buckets "
          f"compiled in {warm:.1f} s ({eng.num_compilations} compilations)")
    rng = random.Random(0)
    for B in args.batch:
        # the first requests decode while the later ones prefill: every request must still be
        # decoding when the timed steps end (they are aborted after), or the batch would shrink
        for i in range(B):
            prompt = [rng.randrange(100, eng.model_config.vocab_size) for _ in range(args.context)]
            eng.add_request(f"b{B}-{i}", {"prompt_token_ids": prompt},
                            SamplingParams(temperature=0, max_tokens=max_model_len - args.context, ignore_eos=True))
        while any(r.num_output_tokens == 0 for r in eng.scheduler.requests.values()):
            eng.step()
        eng.step()
        mm_step = matmul_only_step(eng.runner.step_params, eng.model_config, B)
        fns = [eng.step, mm_step]
        if eng.backend in ("reference", "native"):
            # where the extra time goes: the same forward with and without reading the context,
            # at the rows' context halfway through the timed steps; blocks scattered over the pool
            # as a long-running server's are
            live = [r for r in eng.scheduler.requests.values() if r.status == RequestStatus.RUNNING]
            at = round(float(np.mean([r.num_computed_tokens for r in live])) + args.steps // 2)
            pages = max(p for p in eng.config.page_buckets if p)  # any bucket: the work follows the context
            fns += [forward_step(eng.runner.step_params, eng.model_config, B, at, eng.config.block_size, pages,
                                 with_context=w, shuffled=True, backend=eng.backend, kv_dtype=eng.runner.kv_dtype)
                    for w in (True, False)]
        compiles = eng.num_compilations
        # all in turn, one call of each per round: a noisy machine's drift hits them alike
        full, mm, *fwds = timed_in_turn(fns, args.steps)
        fwd, fwd_noctx = fwds or (None, None)
        decode_compilations = eng.num_compilations - compiles
        live = [r for r in eng.scheduler.requests.values() if r.status == RequestStatus.RUNNING]
        if len(live) != B:
            raise RuntimeError(f"batch {B}: only {len(live)} requests still decoding after the timed steps")
        context = float(np.mean([r.num_computed_tokens for r in live]))
        procs = None
        if args.processors:
            before = eng.num_compilations
            procs = time_processors(eng, live)
            base = procs["no check"]
            print("           logits processors, step ms: " + ", ".join(
                f"{k} {v:.1f} ({v / base - 1:+.1%})" for k, v in procs.items())
                  + f"  [vs no check; {eng.num_compilations - before} compilations]")
            hidden = time_hidden_output(eng, B, 3 * args.steps)
            procs["device_step_ms"], procs["device_step_without_hidden_ms"] = hidden
            print(f"           device step alone: {hidden[0]:.1f} ms, without the hidden-state output "
                  f"{hidden[1]:.1f} ms ({hidden[0] / hidden[1] - 1:+.1%})")
        greedy_ms = time_greedy_choice(eng, B, 3 * args.steps)
        eng.abort_request([f"b{B}-{i}" for i in range(B)])
        row = {"processors_step_ms": procs, "batch": B, "prompt": args.context, "mean_context_after": context, "step_ms": full * 1e3, "matmul_only_ms": mm * 1e3,
               "ratio": full / mm, "decode_tok_s": B / full, "new_compilations": decode_compilations,
               "forward_ms": fwd and fwd * 1e3, "forward_no_context_ms": fwd_noctx and fwd_noctx * 1e3,
               "device_step_greedy_native_xla_ms": greedy_ms}
        rows.append(row)
        print(f"batch {B:>3} (mean context {context:.0f}): step {full * 1e3:7.1f} ms  matmul-only {mm * 1e3:7.1f} ms  ratio {full / mm:4.2f}  "
              f"decode {B / full:7.1f} tok/s  compilations during decode: {row['new_compilations']}")
        if fwd is not None:
            print(f"           forward alone {fwd * 1e3:7.1f} ms, without the context attention "
                  f"{fwd_noctx * 1e3:7.1f} ms: reading the cached context costs {(fwd - fwd_noctx) * 1e3:.1f} ms")
        if greedy_ms:
            print(f"           device step alone (padding rows): greedy tokens chosen natively {greedy_ms[0]:.1f} ms, "
                  f"by XLA's ops {greedy_ms[1]:.1f} ms")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "backend": eng.backend, "kv_cache_dtype": args.kv_cache_dtype, "warmup_s": warm, "buckets": len(buckets),
                       "compilations": eng.num_compilations, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
