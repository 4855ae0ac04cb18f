"""Start-up cost: what a user waits for before the first token, in a first and a second process.

Each run is a fresh Python process that builds `LLM(model, max_model_len=...)` (which compiles
every shape bucket, or loads it from JAX's persistent compilation cache) and then generates a few
prompts; it reports the construction time, the warm-up time, and how many programs the first
`generate` compiled (the engine's compile counter). The first process starts from an empty cache
directory (a temporary one, unless --cache-dir), the second finds what the first wrote.

    python scripts/bench_startup.py                          # SmolLM2-135M, max_model_len 1024
    python scripts/bench_startup.py --model tiny-random --runs 3
Writes results/bench_startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = """
import json, time
t0 = time.perf_counter()
from pagedjax import LLM, SamplingParams
llm = LLM({model!r}, max_model_len={max_model_len})
built = time.perf_counter() - t0
eng = llm.llm_engine
before = eng.num_compilations
t1 = time.perf_counter()
out = llm.generate(["Hello, my name is", "The capital of France is"],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
first = time.perf_counter() - t1
print(json.dumps({{"construct_s": built, "warmup_s": eng.warmup_seconds, "buckets": len(eng.buckets()),
                  "first_generate_s": first, "first_generate_compilations": eng.num_compilations - before,
                  "text": out[0].outputs[0].text}}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--runs", type=int, default=2, help="processes, one after another (the first one cold)")
    p.add_argument("--cache-dir", default=None, help="PAGEDJAX_CACHE for the runs (default: a fresh temporary one)")
    p.add_argument("--json", default="results/bench_startup.json")
    args = p.parse_args(argv)

    cache = args.cache_dir or tempfile.mkdtemp(prefix="pagedjax-startup-")
    model_cache = os.environ.get("PAGEDJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pagedjax")
    env = {**os.environ, "PAGEDJAX_COMPILATION_CACHE": "1", "PAGEDJAX_WARMUP": "1", "JAX_PLATFORMS":
           os.environ.get("JAX_PLATFORMS", "cpu"), "PAGEDJAX_CACHE": cache}
    # the default model's file comes from the usual cache: link it in, so only compilations start cold
    src = os.path.join(model_cache, "smollm2-135m")
    if os.path.isdir(src) and not os.path.exists(os.path.join(cache, "smollm2-135m")):
        os.symlink(src, os.path.join(cache, "smollm2-135m"))
    code = CHILD.format(model=args.model, max_model_len=args.max_model_len)
    runs = []
    for i in range(args.runs):
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        runs.append(r)
        print(f"process {i + 1}: LLM() {r['construct_s']:.1f} s (warm-up {r['warmup_s']:.1f} s, {r['buckets']} "
              f"buckets), first generate {r['first_generate_s']:.2f} s with {r['first_generate_compilations']} "
              f"compilations")
    ratio = runs[-1]["warmup_s"] / runs[0]["warmup_s"]
    print(f"warm-up of the last process / the first: {ratio:.2f}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"model": args.model, "max_model_len": args.max_model_len, "cache_dir": cache, "runs": runs,
                   "warmup_ratio": ratio}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
