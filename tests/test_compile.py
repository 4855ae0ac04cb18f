"""No compilation a user waits for twice: LLM(...) compiles at construction, the first generate
compiles nothing, and a second process loads the compiled programs from the persistent cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pagedjax import LLM, SamplingParams

SMALL = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 32),
             page_buckets=(4, 16), num_blocks=40, block_size=4)


def test_llm_compiles_at_construction_and_first_generate_compiles_nothing(monkeypatch):
    monkeypatch.setenv("PAGEDJAX_WARMUP", "1")
    llm = LLM("tiny-random", **SMALL)
    eng = llm.llm_engine
    assert eng.warmup_seconds is not None and eng.compilations_at_warmup == eng.num_compilations
    before = eng.num_compilations
    sp = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=5, repetition_penalty=1.2, logprobs=2)]
    llm.generate(["hello", "a longer prompt than the first one"], sp, use_tqdm=False)
    assert eng.num_compilations == before


@pytest.mark.parametrize("opt_out", [dict(warmup=False), dict(enforce_eager=True)])
def test_opting_out_compiles_on_first_use(monkeypatch, opt_out):
    monkeypatch.setenv("PAGEDJAX_WARMUP", "1")
    llm = LLM("tiny-random", **SMALL, **opt_out)
    assert llm.llm_engine.warmup_seconds is None
    out = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_default_buckets_follow_the_platform(monkeypatch):
    """Token counts from 8 and on a CPU also 1 (a padding row costs what a real one does there);
    given buckets are kept as given."""
    from pagedjax.config import EngineConfig, platform_token_buckets
    from pagedjax.engine import LLMEngine

    monkeypatch.setenv("PAGEDJAX_WARMUP", "0")
    assert platform_token_buckets(128, "cpu") == (1, 8, 16, 32, 64, 128)
    assert platform_token_buckets(4, "cpu") == (1, 4) and platform_token_buckets(1, "cpu") == (1,)
    assert platform_token_buckets(128, "gpu") == platform_token_buckets(128, "tpu") == (8, 16, 32, 64, 128)
    assert platform_token_buckets(4, "gpu") == (4,)
    assert EngineConfig(max_num_batched_tokens=64, max_model_len=64).token_buckets[0] == 8
    kw = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, num_blocks=40, block_size=4)
    eng = LLMEngine("tiny-random", **kw)
    assert eng.config.token_buckets == (1, 8, 16, 32)
    assert {T for T, _, _ in eng.buckets()} == {1, 8, 16, 32}
    assert LLMEngine("tiny-random", **kw, token_buckets=(8, 32)).config.token_buckets == (8, 32)
    eng.add_request("one", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert [t.bucket[0] for t in eng.step_timings if t.bucket] == [8, 1, 1]   # a prompt of 3, then decodes of 1


def test_machine_key_names_the_versions():
    import jax
    import jaxlib

    from pagedjax.compile_cache import machine_key

    key = machine_key()
    assert f"jax-{jax.__version__}" in key and f"jaxlib-{jaxlib.__version__}" in key
    assert f"_{jax.default_backend()}_" in key


CHILD = textwrap.dedent("""
    import json, time
    import jax
    from jax._src import monitoring
    hits = []
    monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
    from pagedjax import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM("tiny-random", **SMALL)
    start = time.perf_counter() - t0
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    print(json.dumps({"start_s": start, "warmup_s": llm.llm_engine.warmup_seconds, "hits": len(hits),
                      "tokens": out[0].outputs[0].token_ids, "dir": jax.config.jax_compilation_cache_dir}))
""")


def test_a_second_process_loads_the_compiled_programs(tmp_path):
    env = {**os.environ, "PAGEDJAX_CACHE": str(tmp_path), "PAGEDJAX_COMPILATION_CACHE": "1",
           "PAGEDJAX_WARMUP": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    code = f"SMALL = {SMALL!r}\n" + CHILD
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["dir"].startswith(str(tmp_path / "xla")) and os.listdir(first["dir"])
    assert first["hits"] == 0 and second["hits"] > 0
    assert second["tokens"] == first["tokens"]
    print(f"warm-up: first process {first['warmup_s']:.2f} s, second {second['warmup_s']:.2f} s")
