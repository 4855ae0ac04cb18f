"""Decode tokens/s at tensor_parallel_size 1, 2, 4.

On a CPU the devices are XLA's fake host devices (--xla_force_host_platform_device_count=8, set
here): they share the same cores, so this shows that the sharded step runs and compiles once, not
that it scales. On a machine with several GPUs or TPU chips the same command measures real scaling.

The model is a random Llama written to a temp directory as a HF checkpoint, with 8 kv heads so that
2, 4 and 8 all divide it (SmolLM2-135M has 3: only sizes 1 and 3 fit it; pass --model to use it).
For each size: B requests with --context-token prompts are prefilled, then --steps decode steps
are timed through the whole engine (schedule, pack, sharded device step, sampling, update).

    python scripts/bench_tp.py [--sizes 1 2 4] [--batch 16] [--context 128] [--steps 20]
"""

from __future__ import annotations

import os

# before JAX starts: 8 host devices for the CPU platform (ignored by GPU/TPU platforms)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from pagedjax.engine import LLMEngine  # noqa: E402
from pagedjax.sampling_params import SamplingParams  # noqa: E402

# 8 layers, hidden 512, 16 query heads over 8 kv heads of 32, MLP 1536, vocab 8192: ~34M params
RANDOM_LLAMA = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=32, max_position_embeddings=2048)


def write_random_llama(path: Path, c: dict, seed: int = 0) -> None:
    """A HF directory (config.json + model.safetensors, no tokenizer) of random weights, HF's init scale."""
    from pagedjax.model.weights import write_random_llama as write

    write(path, c, seed=seed, matrix_std=0.02)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a HF directory or .gguf (default: the random 8-kv-head Llama)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--json", default="results/bench_tp.json")
    args = ap.parse_args()

    model = args.model
    if model is None:
        model = tempfile.mkdtemp(prefix="bench_tp_")
        write_random_llama(Path(model), RANDOM_LLAMA)
    devices = jax.devices()
    print(f"{len(devices)} {devices[0].platform} device(s): {devices[0].device_kind}")
    rows = []
    for tp in args.sizes:
        # two step shapes only (prefill chunks, decode of the whole batch): warm-up stays short
        budget, max_len, bs = max(256, args.batch), args.context + args.steps + 32, 16
        eng = LLMEngine(model, tensor_parallel_size=tp, attention_backend=args.attention_backend,
                        max_num_seqs=args.batch, max_num_batched_tokens=budget, max_model_len=max_len,
                        block_size=bs, enable_prefix_caching=False, token_buckets=(args.batch, budget),
                        page_buckets=(-(-max_len // bs),))
        warm = eng.warmup()
        rng = random.Random(0)
        for i in range(args.batch):
            prompt = [rng.randrange(3, eng.model_config.vocab_size) for _ in range(args.context)]
            eng.add_request(f"tp{tp}-{i}", {"prompt_token_ids": prompt},
                            SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True))
        while any(r.num_output_tokens == 0 for r in eng.scheduler.requests.values()):
            eng.step()
        eng.step()
        compiles = eng.num_compilations
        ts = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            eng.step()
            ts.append(time.perf_counter() - t0)
        step = float(np.median(ts))
        eng.abort_request([f"tp{tp}-{i}" for i in range(args.batch)])
        r = eng.runner
        row = {"tensor_parallel_size": tp, "batch": args.batch, "context": args.context, "backend": eng.backend,
               "warmup_s": warm, "decode_step_ms": step * 1e3, "decode_tok_s": args.batch / step,
               "new_compilations": eng.num_compilations - compiles, "num_blocks": r.num_blocks,
               "kv_bytes_per_device": r.kv_bytes_per_device,
               "kv_tokens_per_gib_per_device": r.num_blocks * eng.config.block_size / (r.kv_bytes_per_device / 2**30)}
        rows.append(row)
        print(f"tp {tp}: decode step {step * 1e3:7.1f} ms  {args.batch / step:7.1f} tok/s  "
              f"KV pool {r.kv_bytes_per_device / 2**20:6.1f} MiB/device "
              f"({row['kv_tokens_per_gib_per_device']:,.0f} tokens per GiB per device)  "
              f"warmup {warm:.1f} s  compilations during decode: {row['new_compilations']}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"model": args.model or f"random Llama {RANDOM_LLAMA}", "platform": devices[0].platform,
                       "device_kind": devices[0].device_kind, "num_devices": len(devices), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
