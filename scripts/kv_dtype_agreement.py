"""Greedy agreement of a bfloat16 KV pool with transformers (and with the float32 pool), on the
default model: 8 chat prompts, up to 64 tokens (to the model's eos), the engine in float32 with its KV pool in each dtype,
transformers' `generate` on the same GGUF in float32. Reports, per prompt, how many leading tokens
match and the share of matching positions; drift is reported, not hidden.

    python scripts/kv_dtype_agreement.py [--max-tokens 64] [--json results/kv_dtype_agreement.json]
"""

from __future__ import annotations

import argparse
import json
import os

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain photosynthesis in one sentence.", "List three prime numbers.",
             "Who wrote Romeo and Juliet?", "How do I boil an egg?",
             "Translate 'good morning' into Spanish.", "What is 12 times 11?"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default="results/kv_dtype_agreement.json")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from pagedjax import LLM, SamplingParams
    from pagedjax.model.hub import default_model_path

    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)   # both sides stop at the model's eos
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    ours, prompts = {}, None
    for kv in ("auto", "bfloat16"):
        llm = LLM("smollm2-135m", kv_cache_dtype=kv, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256,
                  warmup=False)
        outs = llm.chat(convs, sp, use_tqdm=False)
        ours[kv] = [o.outputs[0].token_ids for o in outs]
        prompts = [o.prompt_token_ids for o in outs]
    eos = set(llm.llm_engine.eos_token_ids)
    gguf = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ref = []
    with torch.no_grad():
        for p in prompts:   # one at a time: no padding
            g = hf.generate(torch.tensor([p]), max_new_tokens=args.max_tokens, do_sample=False, pad_token_id=0)
            row = g[0, len(p):].tolist()
            ref.append(row[:next((i + 1 for i, t in enumerate(row) if t in eos), len(row))])

    def compare(a, b):
        lead = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return {"leading_equal": lead, "identical": a == b, "length": len(b)}

    report = {"max_tokens": args.max_tokens}
    for kv in ("auto", "bfloat16"):
        rows = [compare(o, r) for o, r in zip(ours[kv], ref)]
        report[f"{kv}_vs_hf"] = rows
        print(f"KV pool {kv:>8} vs HF: identical outputs {sum(r['identical'] for r in rows)}/8, "
              f"leading equal tokens {[r['leading_equal'] for r in rows]} of {[r['length'] for r in rows]}")
    rows = [compare(a, b) for a, b in zip(ours["bfloat16"], ours["auto"])]
    report["bfloat16_vs_float32"] = rows
    print(f"bfloat16 vs float32 pool: leading equal tokens {[r['leading_equal'] for r in rows]}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
