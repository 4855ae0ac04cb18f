"""A KV pool in another dtype than the model's: bfloat16 halves the bytes attention reads per step,
and attention still accumulates in float32."""

from __future__ import annotations

import pytest

from pagedjax import LLM, SamplingParams

KW = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_blocks=80, block_size=8, warmup=False)


def test_bfloat16_pool_follows_the_float32_greedy_tokens():
    prompts = [{"prompt_token_ids": [5 + (7 * i + 3 * j) % 300 for j in range(6 + 5 * i)]} for i in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for kv in ("auto", "bfloat16"):
        llm = LLM("tiny-random", kv_cache_dtype=kv, **KW)
        runner = llm.llm_engine.runner
        assert str(runner.kv_dtype) == ("float32" if kv == "auto" else "bfloat16")
        # the native CPU backend stores bfloat16 values as their uint16 bits
        assert runner.kv_cache[0].dtype.itemsize == (4 if kv == "auto" else 2)
        outs[kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    same = sum(a == b for x, y in zip(outs["auto"], outs["bfloat16"]) for a, b in zip(x, y))
    total = sum(len(x) for x in outs["auto"])
    # rounding K and V to 8 bits of mantissa may flip a near-tie; it must stay rare
    assert same / total >= 0.9, (same, total)


def test_bad_kv_cache_dtype_names_the_field():
    with pytest.raises(ValueError, match=r"^kv_cache_dtype must be .*got 'fp8'$"):
        LLM("tiny-random", kv_cache_dtype="fp8", **KW)
