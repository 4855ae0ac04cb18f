"""What `LLM.update_weights` costs against one device copy of the params, and that it compiles nothing.

    python scripts/bench_weight_update.py [--model smollm2-135m] [--repeats 7]

Alternates two sets of weights (the loaded ones and the same scaled by 1.0001), each update
followed by a short greedy generation; times, in turn: update_weights (checks, one device copy,
the prefix cache emptied), update_weights(copy=False) (the caller's arrays used as they are), and
a plain device copy of the params. Prints medians and the compilations after warm-up (0 expected).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from pagedjax import LLM, SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    llm = LLM(args.model, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(8, 64),
              page_buckets=(16,))   # compiles every bucket
    original = llm.params
    scaled = jax.tree.map(lambda w: w * 1.0001, original)
    jax.block_until_ready(scaled)
    n = llm.llm_engine.num_compilations

    def timed(f):
        t = time.perf_counter()
        f()
        return time.perf_counter() - t

    def device_copy():
        jax.block_until_ready(jax.tree.map(lambda w: jax.device_put(w, w.sharding, may_alias=False), scaled))

    update, no_copy, plain = [], [], []
    for i in range(args.repeats):
        params = scaled if i % 2 == 0 else original
        update.append(timed(lambda: llm.update_weights(params)))
        no_copy.append(timed(lambda: llm.update_weights(params, copy=False)))
        plain.append(timed(device_copy))
        llm.generate([{"prompt_token_ids": [100, 200, 300]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    mib = sum(w.nbytes for w in jax.tree.leaves(original)) / 2**20
    print(f"{args.model}: params {mib:.0f} MiB on {jax.devices()[0].platform}; medians of {args.repeats}: "
          f"update_weights {np.median(update) * 1e3:.1f} ms, update_weights(copy=False) {np.median(no_copy) * 1e3:.1f} ms, "
          f"one device copy {np.median(plain) * 1e3:.1f} ms; compilations after warm-up: "
          f"{llm.llm_engine.num_compilations - n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
