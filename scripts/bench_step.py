"""What one decode step of the real model costs, against the matmuls it cannot avoid.

For each batch size B: B requests with ~`--context`-token prompts are prefilled, then `--steps`
decode steps are timed through the whole engine (schedule, pack, device step, sampling,
update). Beside it, in the same process, a jitted *matmul-only* step of the same model and
batch: embeddings, every projection, the MLP and the output head, no attention, no KV write,
no sampling, no host work. The ratio full / matmul-only says what attention, KV writes,
sampling and host work add on top of the unavoidable part.

    python scripts/bench_step.py [--model smollm2-135m] [--batch 1 8 32 64] [--context 200]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.engine import LLMEngine
from pagedjax.model.llama import _attn_out_and_mlp, _linear, rms_norm
from pagedjax.sampling_params import SamplingParams


def matmul_only_step(params, cfg, B: int):
    """Embeddings, q/k/v/o projections, MLP and head for B tokens; attention replaced by q."""

    @jax.jit
    def f(params, token_ids):
        x = params["embed_tokens"][token_ids]

        def layer(x, lp):
            h = rms_norm(x, lp["input_layernorm"], cfg.rms_norm_eps)
            q = _linear(h, lp["q_proj"], lp, "q_bias")
            k = _linear(h, lp["k_proj"], lp, "k_bias")
            v = _linear(h, lp["v_proj"], lp, "v_bias")
            # keep k and v alive without attention: a negligible reduction
            o = q + (k.sum() + v.sum()) * 0
            return _attn_out_and_mlp(cfg, lp, x, o), None

        x, _ = jax.lax.scan(layer, x, params["layers"])
        h = rms_norm(x, params["norm"], cfg.rms_norm_eps)
        w = params["embed_tokens"].T if cfg.tie_word_embeddings else params["lm_head"]
        return jnp.argmax(h @ w, axis=-1)

    ids = jnp.zeros(B, jnp.int32)
    jax.block_until_ready(f(params, ids))
    return lambda: jax.block_until_ready(f(params, ids))


def timed(fn, n):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)), ts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default="results/bench_step.json")
    args = ap.parse_args()
    rows = []
    max_b = max(args.batch)
    # buckets: each measured batch size is a token bucket of its own (no padded rows), 256-token
    # prefill chunks, and block tables up to 32 pages (512 tokens): contexts here stay near --context
    budget = 256
    eng = LLMEngine(args.model, dtype=args.dtype, max_num_seqs=max_b, max_num_batched_tokens=budget,
                    max_model_len=512, attention_backend=args.attention_backend, enable_prefix_caching=False,
                    token_buckets=tuple(sorted(set(args.batch) | {budget})), seq_buckets=tuple(sorted(set(args.batch))),
                    page_buckets=(8, 16, 32))
    t0 = time.perf_counter()
    buckets = eng.buckets()
    warm = eng.warmup()
    print(f"{args.model}: {jax.devices()[0].platform}, backend {eng.backend}, {len(buckets)} buckets "
          f"compiled in {warm:.1f} s ({eng.num_compilations} compilations)")
    rng = random.Random(0)
    for B in args.batch:
        for i in range(B):
            prompt = [rng.randrange(100, eng.model_config.vocab_size) for _ in range(args.context)]
            eng.add_request(f"b{B}-{i}", {"prompt_token_ids": prompt},
                            SamplingParams(temperature=0, max_tokens=args.steps + 20, ignore_eos=True))
        while any(r.num_output_tokens == 0 for r in eng.scheduler.requests.values()):
            eng.step()
        eng.step()
        compiles = eng.num_compilations
        full, _ = timed(eng.step, args.steps)
        mm, _ = timed(matmul_only_step(eng.runner.params, eng.model_config, B), args.steps)
        for rid in list(eng._groups):
            eng.abort_request(rid)
        row = {"batch": B, "context": args.context, "step_ms": full * 1e3, "matmul_only_ms": mm * 1e3,
               "ratio": full / mm, "decode_tok_s": B / full, "new_compilations": eng.num_compilations - compiles}
        rows.append(row)
        print(f"batch {B:>3}: step {full * 1e3:7.1f} ms  matmul-only {mm * 1e3:7.1f} ms  ratio {full / mm:4.2f}  "
              f"decode {B / full:7.1f} tok/s  compilations during decode: {row['new_compilations']}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "backend": eng.backend, "warmup_s": warm, "buckets": len(buckets),
                       "compilations": eng.num_compilations, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
