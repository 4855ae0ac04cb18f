"""The engine end to end on the CPU: `LLM(...)` against Hugging Face, recompiles, batch invariance,
beam search, n > 1 and prefix caching, bad input, streaming, stop strings, logprobs, interrupts
and non-finite logits.

Compiling a bucket of the tiny models costs a few seconds on two cores, so engines are built
once per module (the fixtures below) with few buckets, and each test draws its prompts from a
seed of its own, so the prefix cache one test leaves behind gives another no hits it did not plan.
"""

from __future__ import annotations

from collections import Counter

import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import (SMALL, TINY_HF, assert_pool_clean, hf_beam, hf_greedy, hf_logprobs, ids, make_tiny_hf,
                            num_chunked_rows, recording_schedules)
from helpers import require_native
from pagedjax import LLM, RequestOutputKind, SamplingParams
from pagedjax import BeamSearchParams
from pagedjax.testing import ByteTokenizer

VOCAB = TINY_HF["vocab_size"]
GREEDY = SamplingParams(temperature=0, max_tokens=32)


# -- engines ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    hf = make_tiny_hf()
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path)  # config.json + model.safetensors; no tokenizer files
    return hf, path


@pytest.fixture(scope="module")
def tiny_llm(hf_tiny):
    """LLM on the saved HF directory, one per (backend, options), built on first use."""
    engines = {}

    def get(backend="reference", **kw):
        key = (backend, tuple(sorted(kw.items())))
        if key not in engines:
            engines[key] = LLM(str(hf_tiny[1]), attention_backend=backend, **{**SMALL, **kw})
        return engines[key]

    return get


@pytest.fixture(scope="module")
def llm_ref(tiny_llm):
    return tiny_llm("reference")


def _nan_for_seed_666(logits, a):
    """logits_hook: the rows of a request seeded 666 get non-finite logits."""
    return jnp.where((a.sampling.seeds[:, 0] == 666)[:, None], jnp.nan, logits)


@pytest.fixture(scope="module")
def crowd_llm():
    """tiny-random with 32 seats (one request among 31 others); one page bucket keeps compiles to
    one per token bucket. Its logits_hook poisons requests seeded 666 (and nothing else)."""
    return LLM("tiny-random", max_num_seqs=32, max_num_batched_tokens=64, max_model_len=128, block_size=8,
               page_buckets=(16,), logits_hook=_nan_for_seed_666)


@pytest.fixture(scope="module")
def warm_llm():
    """tiny-random, a small pool (19 usable blocks: barely more than one 128-token request),
    every bucket compiled ahead of time (2 token x 2 page buckets keep the warm-up short)."""
    llm = LLM("tiny-random", num_blocks=20, token_buckets=(16, 32), page_buckets=(8, 16), **SMALL)
    llm.warmup()
    return llm


@pytest.fixture(scope="module")
def swap_llm():
    """Swap preemption; one step bucket, warmed up with the block copy, swap-out and swap-in buckets."""
    llm = LLM("tiny-random", num_blocks=20, preemption_mode="swap", token_buckets=(32,), page_buckets=(16,),
              **SMALL)
    llm.warmup()
    return llm


def prompts_of(rng, lengths, lo=3, hi=VOCAB):
    return [rng.integers(lo, hi, n).tolist() for n in lengths]


# -- parity with Hugging Face ----------------------------------------------------------------------
PARITY_LENGTHS = (1, 5, 9, 17, 26, 33, 47, 60)  # 198 prompt tokens against a 32-token step budget


@pytest.fixture(scope="module")
def parity_case(hf_tiny):
    hf, _ = hf_tiny
    prompts = prompts_of(np.random.default_rng(100), PARITY_LENGTHS)
    return prompts, [hf_greedy(hf, p, 32) for p in prompts]


@pytest.mark.parametrize("backend", ["reference", "native", "pallas"])
def test_greedy_matches_hf_generate(tiny_llm, parity_case, backend):
    """8 prompts of different lengths run together, prefills chunked to the 32-token budget and
    mixed with decodes: 32 greedy tokens each, identical to HF generate."""
    if backend == "native":
        require_native()
    prompts, expected = parity_case
    assert len({tuple(e[:8]) for e in expected}) == 8 and all(len(set(e)) > 8 for e in expected)  # not degenerate
    llm = tiny_llm(backend)
    eng = llm.llm_engine
    assert eng.backend == backend
    with recording_schedules(eng) as outs:
        results = llm.generate([ids(p) for p in prompts], GREEDY, use_tqdm=False)
    for p, exp, r in zip(prompts, expected, results):
        assert r.prompt_token_ids == p
        assert r.outputs[0].token_ids == exp, f"prompt of {len(p)} tokens"
        assert r.outputs[0].finish_reason == ("stop" if exp[-1] == 2 else "length")
    assert num_chunked_rows(outs) >= 3  # the 33-, 47- and 60-token prompts cannot fit one step
    assert max(o.num_rows for o in outs) == 8 and any(o.num_decode_tokens and o.num_prefill_tokens for o in outs)
    assert_pool_clean(eng)


def test_logprobs_match_hf(llm_ref, hf_tiny):
    """logprobs=k: per token the top k and the sampled one, the model's log_softmax as HF computes it."""
    hf, _ = hf_tiny
    prompt = prompts_of(np.random.default_rng(101), [11])[0]
    out = llm_ref.generate([ids(prompt)], SamplingParams(temperature=0, max_tokens=6, logprobs=3),
                           use_tqdm=False)[0].outputs[0]
    toks, lps = out.token_ids, out.logprobs
    assert len(lps) == len(toks) == 6
    ref = hf_logprobs(hf, prompt + toks)[len(prompt) - 1: len(prompt) - 1 + len(toks)]
    for i, (tok, d) in enumerate(zip(toks, lps)):
        top3 = np.argsort(-ref[i])[:3].tolist()
        assert set(d) == set(top3) | {tok} and tok == top3[0]  # greedy samples the top token
        for t, lp in d.items():
            assert abs(lp.logprob - ref[i, t]) <= 1e-4 * max(1.0, abs(ref[i, t])), (i, t)
            assert lp.rank == 1 + int(np.sum(ref[i] > ref[i, t]))  # ranks from 1, as vLLM counts them
            assert lp.decoded_token is None  # this checkpoint has no tokenizer
    assert out.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(toks, lps)), abs=1e-5)
    # without logprobs asked: none returned
    plain = llm_ref.generate([ids(prompt)], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert plain.outputs[0].logprobs is None


def test_top_logprobs_are_computed_only_in_steps_that_ask_for_them(llm_ref):
    """The top-k over the whole vocabulary is a call of its own: a step in which no row asks for
    top logprobs (logprobs None or 0) returns none ([S, 0]); one in which a row does, max_logprobs
    per row, and the request gets its k."""
    eng = llm_ref.llm_engine
    widths = []
    eng.runner.fetch = lambda d, fetch=eng.runner.fetch: (widths.append(d.results[3].shape[1]), fetch(d))[1]
    try:
        prompt = ids(prompts_of(np.random.default_rng(102), [9])[0])
        for logprobs in (None, 0):
            out = llm_ref.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=logprobs),
                                   use_tqdm=False)[0].outputs[0]
            assert widths and set(widths) == {0}, (logprobs, widths)
            assert out.logprobs is None if logprobs is None else all(len(d) == 1 for d in out.logprobs)
            widths.clear()
        out = llm_ref.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=2), use_tqdm=False)
        assert widths and set(widths) == {eng.max_logprobs}, widths
        assert all(len(d) in (2, 3) for d in out[0].outputs[0].logprobs)
    finally:
        del eng.runner.fetch


def check_prompt_logprobs(plp, prompt, ref, k):
    """vLLM's prompt_logprobs against HF's log_softmax `ref` over the prompt."""
    assert len(plp) == len(prompt) and plp[0] is None
    for j in range(1, len(prompt)):
        row, tok = ref[j - 1], prompt[j]
        top = np.argsort(-row)[:k].tolist()
        assert set(plp[j]) == set(top) | {tok}, j
        for t, lp in plp[j].items():
            assert abs(lp.logprob - row[t]) <= 1e-4 * max(1.0, abs(row[t])), (j, t)
            assert lp.rank == 1 + int(np.sum(row > row[t]))


def test_prompt_logprobs_match_hf(llm_ref, hf_tiny):
    """prompt_logprobs=k: for every prompt token after the first, its logprob and rank and the top
    k, as HF computes them; also when the prompt is prefilled in chunks (a 70-token prompt, a
    32-token step budget), when it is entirely in the prefix cache, and for n > 1."""
    hf, _ = hf_tiny
    prompt = prompts_of(np.random.default_rng(102), [70])[0]
    ref = hf_logprobs(hf, prompt)
    eng = llm_ref.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    first = llm_ref.generate([ids(prompt)], sp, use_tqdm=False)[0]
    check_prompt_logprobs(first.prompt_logprobs, prompt, ref, 2)
    # the same prompt again: its blocks are cached, but prompt logprobs need every token's logits
    again = llm_ref.generate([ids(prompt)], sp.replace(prompt_logprobs=0, n=2, temperature=0.5, seed=1),
                             use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    check_prompt_logprobs(again.prompt_logprobs, prompt, ref, 0)
    assert first.outputs[0].logprobs is None  # prompt_logprobs alone asks for no sample logprobs
    plain = llm_ref.generate([ids(prompt)], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0
    one = llm_ref.generate([ids(prompt[:1])], sp, use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]
    # streamed as deltas: the prompt logprobs come once
    eng.add_request("delta", ids(prompt[:20]), sp.replace(output_kind=RequestOutputKind.DELTA))
    stream = []
    while eng.has_unfinished_requests():
        stream += eng.step()
    with_plp = [o for o in stream if o.prompt_logprobs is not None]
    assert len(stream) == 3 and len(with_plp) == 1
    check_prompt_logprobs(with_plp[0].prompt_logprobs, prompt[:20], ref, 2)
    assert_pool_clean(eng)


# -- zero recompiles -----------------------------------------------------------------------------------
def test_no_recompilation_after_warmup(warm_llm):
    """2,000 steps of arrivals, finishes, chunked prefills, aborts, forks (n=2) and preemptions in a
    19-block pool, requests with random mixes of the logits processors (penalties, logit_bias,
    allowed_token_ids, bad_words, min_tokens) and prompt logprobs among plain ones: the compile
    counter does not move after warmup()."""
    eng = warm_llm.llm_engine
    assert eng.warmup_seconds is not None
    n_compiled = eng.num_compilations  # the counter is process-wide: nothing may compile from here on
    rng = np.random.default_rng(7)
    system = rng.integers(3, 384, 24).tolist()  # a shared prefix: prefix-cache hits too
    live: set[str] = set()
    counts = Counter()
    buckets = set()
    orig_pack = eng.packer.pack

    def pack(out, kv):
        step = orig_pack(out, kv)
        buckets.add(step.bucket)
        return step

    orig_pack_logits = eng.logits_packer.pack

    def pack_logits(out, S):
        procs = orig_pack_logits(out, S)
        counts["steps with processors" if procs is not None else "steps without"] += 1
        return procs

    eng.packer.pack = pack
    eng.logits_packer.pack = pack_logits
    try:
        with recording_schedules(eng) as outs:
            for _ in range(2000):
                if len(live) < 16 and rng.random() < 0.3:
                    plen = int(rng.integers(1, 90))
                    prompt = (system if rng.random() < 0.3 else []) + rng.integers(3, 384, plen).tolist()
                    prompt = prompt[:100]
                    kind = rng.integers(4)  # greedy, top-k with logprobs, top-p + min-p, n=2 samples
                    max_tokens = int(rng.integers(1, min(40, 128 - len(prompt)) + 1))
                    sp = SamplingParams(
                        n=2 if kind == 3 else 1, temperature=0.0 if kind == 0 else 0.9,
                        top_k=int(rng.integers(1, 50)) if kind == 1 else -1, top_p=0.8 if kind == 2 else 1.0,
                        min_p=0.05 if kind == 2 else 0.0, ignore_eos=bool(rng.random() < 0.5),
                        max_tokens=max_tokens, logprobs=2 if kind == 1 else None,
                        prompt_logprobs=int(rng.integers(0, 3)) if rng.random() < 0.15 else None,
                        **processor_mix(rng, max_tokens))
                    live.add(eng.add_request(None, ids(prompt), sp))
                    counts["arrived"] += 1
                if live and rng.random() < 0.02:
                    victim = sorted(live)[int(rng.integers(len(live)))]
                    eng.abort_request(victim)
                    live.discard(victim)
                    counts["aborted"] += 1
                for out in eng.step():
                    if out.finished:
                        live.discard(out.request_id)
                        counts["finished"] += 1
            while eng.has_unfinished_requests():
                eng.step()
    finally:
        del eng.packer.pack, eng.logits_packer.pack
    counts["preempted"] = sum(len(o.preempted) for o in outs)
    counts["chunked"] = num_chunked_rows(outs)
    counts["prefix_hit_tokens"] = sum(o.prefix_hit_tokens for o in outs)
    counts["cow_copies"] = sum(len(o.block_copies) for o in outs)
    assert counts["arrived"] > 150 and counts["finished"] > 100, counts
    assert counts["aborted"] > 10 and counts["preempted"] > 20 and counts["chunked"] > 50, counts
    assert counts["prefix_hit_tokens"] > 0 and counts["cow_copies"] > 0, counts
    assert counts["steps with processors"] > 500 and counts["steps without"] > 50, counts
    assert buckets == set(eng.buckets()), buckets  # every warmed bucket was used
    assert eng.num_compilations == n_compiled, "a bucket compiled after warmup()"
    assert_pool_clean(eng)


# -- batch invariance ----------------------------------------------------------------------------------
TARGET = list(range(40, 52))
TARGET_SP = {
    "plain": SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True),
    # every logits processor at once (the byte tokenizer makes "ab" the tokens of "a" and "b")
    "processors": SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=24, min_tokens=24,
                                 repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                                 logit_bias={100: 3.0, 101: -5.0}, bad_words=["ab"]),
}


def processor_mix(rng, max_tokens: int) -> dict:
    """A random mix of the logits processors' parameters (some rows none)."""
    kw = {}
    if rng.random() < 0.5:
        kw.update(repetition_penalty=float(rng.choice([0.8, 1.2])), presence_penalty=float(rng.uniform(-1, 1)),
                  frequency_penalty=float(rng.uniform(-1, 1)))
    if rng.random() < 0.3:
        kw["logit_bias"] = {int(t): float(rng.uniform(-5, 5)) for t in rng.integers(3, 384, 4)}
    if rng.random() < 0.2:
        kw["allowed_token_ids"] = sorted({int(t) for t in rng.integers(3, 384, 40)})
    if rng.random() < 0.2:
        kw["bad_words"] = ["the", "a"]
    if rng.random() < 0.3:
        kw["min_tokens"] = int(rng.integers(1, max_tokens + 1))
    return kw


@pytest.fixture(scope="module", params=sorted(TARGET_SP))
def target(request, crowd_llm):
    """(params, tokens) of the target request alone."""
    sp = TARGET_SP[request.param]
    out = crowd_llm.generate([ids(TARGET)], sp, use_tqdm=False)[0]
    toks = out.outputs[0].token_ids
    assert len(toks) == 24 and len(set(toks)) > 8  # really sampled, not a repeated token
    return sp, toks


def test_seeded_request_same_among_31_others(crowd_llm, target):
    """The target alone and among 31 others, some with logits processors and some without: the same
    tokens (a plain target runs through the processors' program when a neighbour uses them)."""
    target_sp, target_alone = target
    rng = np.random.default_rng(11)
    prompts, params = [], []
    for i in range(31):
        prompts.append(ids(rng.integers(3, 384, int(rng.integers(1, 30))).tolist()))
        params.append(SamplingParams(temperature=float(rng.choice([0.0, 0.7, 1.0])), top_k=int(rng.choice([-1, 20])),
                                     seed=None if i % 2 else i, max_tokens=12 + i, ignore_eos=True,
                                     **(processor_mix(rng, 12) if i % 3 else {})))
    prompts.insert(17, ids(TARGET))
    params.insert(17, target_sp)
    eng = crowd_llm.llm_engine
    with recording_schedules(eng) as outs:
        results = crowd_llm.generate(prompts, params, use_tqdm=False)
    assert results[17].outputs[0].token_ids == target_alone
    assert max(o.num_rows for o in outs) == 32  # at some step all 32 ran together
    # the same request arriving while the others are mid-flight
    for p, sp in zip(prompts[:8], params[:8]):
        eng.add_request(None, p, sp)
    for _ in range(5):
        eng.step()
    late = crowd_llm.generate([ids(TARGET)], target_sp, use_tqdm=False)[0]
    while eng.has_unfinished_requests():
        eng.step()
    assert late.outputs[0].token_ids == target_alone
    assert_pool_clean(eng)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_request_same_after_preemption(warm_llm, swap_llm, target, mode):
    """Three long requests admitted first outgrow the 19-block pool: the newest running request,
    the target, is preempted (recomputed or swapped out and back) and still samples the same tokens."""
    target_sp, target_alone = target
    llm = warm_llm if mode == "recompute" else swap_llm
    eng = llm.llm_engine
    assert eng.config.preemption_mode == mode
    n_compiled = eng.num_compilations
    rng = np.random.default_rng(12)
    others = [ids(p) for p in prompts_of(rng, [30, 30, 30], hi=384)]
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with recording_schedules(eng) as outs:
        results = llm.generate(others + [ids(TARGET)], [long] * 3 + [target_sp], use_tqdm=False)
    target = results[3]
    assert target.metrics.num_preemptions >= 1
    if mode == "swap":
        assert any(o.swap_out for o in outs) and any(o.swap_in for o in outs)
    assert target.outputs[0].token_ids == target_alone
    assert all(len(r.outputs[0].token_ids) == 60 for r in results[:3])
    assert eng.num_compilations == n_compiled  # warmed up: preemption, swaps included, compiles nothing
    assert_pool_clean(eng)


# -- beam search ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_hf(llm_ref, hf_tiny, width):
    hf, _ = hf_tiny
    N = 16
    eng = llm_ref.llm_engine
    for prompt in prompts_of(np.random.default_rng(200 + width), [7, 19]):
        expected = hf_beam(hf, prompt, width, N)
        out = llm_ref.beam_search([ids(prompt)], BeamSearchParams(beam_width=width, max_tokens=N, ignore_eos=True))[0]
        assert len(out.sequences) == width
        assert all(b.tokens[:len(prompt)] == prompt and len(b.tokens) == len(prompt) + N for b in out.sequences)
        # the best beam, and in fact every final beam in order, with HF's score
        assert out.sequences[0].tokens[len(prompt):] == expected[0][0], f"width {width}, prompt of {len(prompt)}"
        for b, (exp_tokens, exp_score) in zip(out.sequences, expected):
            assert b.tokens[len(prompt):] == exp_tokens
            assert b.cum_logprob / N == pytest.approx(exp_score, abs=1e-4)
        # beams share the prompt's full blocks and every common prefix (a 7-token prompt fills no
        # block: beams of different parents then share nothing, so only <= holds there)
        assert 0 < out.physical_blocks_peak <= out.cloned_blocks_peak, out
        if len(prompt) >= 2 * eng.config.block_size:
            assert out.physical_blocks_peak < out.cloned_blocks_peak, out
        assert_pool_clean(eng)


# -- n > 1 and prefix caching -----------------------------------------------------------------------------
def test_n_samples_share_prompt_blocks(llm_ref):
    eng = llm_ref.llm_engine
    bs = eng.config.block_size
    prompt = prompts_of(np.random.default_rng(300), [20])[0]  # 2 full blocks + 4 tokens
    sp = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    n_steps = len(eng.scheduler.metrics.steps)
    rid = eng.add_request("nshare", ids(prompt), sp)
    eng.step()  # the prompt is prefilled once; 3 samples fork from it
    kv = eng.scheduler.kv
    tables = [kv.req_to_blocks[r] for r in (rid, f"{rid}#1", f"{rid}#2", f"{rid}#3")]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 3
    assert kv.usage().used_blocks == 3 and all(kv.pool.ref_cnt[b] == 4 for b in tables[0])
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            final = out
    steps = eng.scheduler.metrics.steps[n_steps:]
    assert sum(s.num_prefill_tokens for s in steps) == len(prompt)
    # 36 tokens = 5 blocks per sample if cloned (20 blocks); shared: 2 full prompt blocks + 3 each
    assert max(s.used_blocks for s in steps) == 2 + 4 * 3 < 4 * -(-36 // bs)
    assert final.finished and [o.index for o in final.outputs] == [0, 1, 2, 3]
    samples = [tuple(o.token_ids) for o in final.outputs]
    assert all(len(s) == 16 for s in samples) and len(set(samples)) == 4
    assert_pool_clean(eng)


def _system_prompt_workload(rng):
    system = rng.integers(3, VOCAB, 24).tolist()  # 3 full blocks of 8
    users = prompts_of(rng, [5, 9, 3, 7])
    return system, [system + u for u in users]


def test_shared_system_prompt_prefilled_once(llm_ref):
    eng = llm_ref.llm_engine
    system, prompts = _system_prompt_workload(np.random.default_rng(301))
    sp = SamplingParams(temperature=0, max_tokens=8)
    first = llm_ref.generate([ids(prompts[0])], sp, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    n_steps = len(eng.scheduler.metrics.steps)
    rest = llm_ref.generate([ids(p) for p in prompts[1:]], sp, use_tqdm=False)
    steps = eng.scheduler.metrics.steps[n_steps:]
    assert [r.num_cached_tokens for r in rest] == [24, 24, 24]
    assert sum(s.prefix_hit_tokens for s in steps) == 3 * 24
    assert sum(s.prefix_query_tokens for s in steps) == sum(len(p) for p in prompts[1:])
    # only the user turns were prefilled
    assert sum(s.num_prefill_tokens for s in steps) == sum(len(p) - 24 for p in prompts[1:])
    assert_pool_clean(eng)


def test_outputs_same_with_and_without_prefix_caching(tiny_llm):
    """Shared prefixes (two waves, so the second hits the first's blocks) and an n=4 seeded request:
    identical tokens with enable_prefix_caching on and off."""
    _, prompts = _system_prompt_workload(np.random.default_rng(302))
    greedy = SamplingParams(temperature=0, max_tokens=12)
    sampled = SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)
    results = {}
    for caching in (True, False):
        llm = tiny_llm("reference") if caching else tiny_llm("reference", enable_prefix_caching=False)
        wave1 = llm.generate([ids(prompts[0])], greedy, use_tqdm=False)
        wave2 = llm.generate([ids(p) for p in prompts[1:]] + [ids(prompts[0])], [greedy] * 3 + [sampled],
                             use_tqdm=False)
        results[caching] = [[o.token_ids for o in r.outputs] for r in wave1 + wave2]
        hits = sum(r.num_cached_tokens for r in wave2)
        assert (hits >= 4 * 24) if caching else (hits == 0)
        assert_pool_clean(llm.llm_engine)
    assert results[True] == results[False]


# -- bad input -------------------------------------------------------------------------------------------
def _gen(prompt, **sp):
    def run(llm):
        return llm.generate([prompt], SamplingParams(**{"max_tokens": 4, **sp}), use_tqdm=False)
    return run


def _unsupported_arch(tmp_path):
    from transformers import GPT2Config

    GPT2Config(architectures=["GPT2LMHeadModel"], n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    return LLM(str(tmp_path))


GOOD = list(range(60, 75))
BAD_REQUESTS = {
    "prompt of max_model_len tokens": (_gen(ids([5] * 128), max_tokens=1),
                                       r"decoder prompt \(length 128\) is longer than the maximum model length of 128"),
    "empty prompt": (_gen(ids([])), r"prompt_token_ids is empty: it must contain at least 1 token"),
    "token id = vocab_size": (_gen(ids([5, VOCAB])), rf"prompt_token_ids must be ints in \[0, vocab_size={VOCAB}\)"),
    "negative token id": (_gen(ids([-1, 5])), rf"prompt_token_ids must be ints in \[0, vocab_size={VOCAB}\)"),
    "max_tokens 0": (_gen(ids(GOOD), max_tokens=0), r"max_tokens must be at least 1, got 0"),
    "temperature < 0": (_gen(ids(GOOD), temperature=-0.5), r"temperature must be non-negative"),
    "top_p 0": (_gen(ids(GOOD), top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    "top_p > 1": (_gen(ids(GOOD), top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    "top_k -2": (_gen(ids(GOOD), top_k=-2), r"top_k must be 0 \(disable\), or at least 1, got -2"),
    "min_p < 0": (_gen(ids(GOOD), min_p=-0.1), r"min_p must be in \[0, 1\], got -0.1"),
    "min_p > 1": (_gen(ids(GOOD), min_p=1.5), r"min_p must be in \[0, 1\], got 1.5"),
    "n 0": (_gen(ids(GOOD), n=0), r"n must be at least 1, got 0"),
    "n > max_num_seqs": (_gen(ids(GOOD), n=9), r"n \(9\) exceeds max_num_seqs \(8\)"),
    "string prompt without a tokenizer": (_gen("hello"), r"no tokenizer"),
    "bad prompt among good ones": (lambda llm: llm.generate([ids(GOOD), ids([VOCAB + 5])], GREEDY, use_tqdm=False),
                                   r"vocab_size=320"),
}
BAD_ENGINES = {
    "unknown model path": (lambda tmp: LLM(str(tmp / "no-such-model")), FileNotFoundError, r"does not exist"),
    "unsupported architecture": (_unsupported_arch, ValueError,
                                 r"architectures=\['GPT2LMHeadModel'\].*supported architectures: LlamaForCausalLM"),
    "pool too small for one max_model_len request": (
        lambda tmp: LLM("tiny-random", num_blocks=8, **SMALL), ValueError,
        r"num_blocks \(8\) leaves 7 usable blocks, fewer than one max_model_len \(128\) request needs \(16 blocks"),
    "block_size the kernel cannot take": (
        lambda tmp: LLM("tiny-random", attention_backend="pallas", **{**SMALL, "block_size": 12}), ValueError,
        r"block_size \(12\) must be one of \(8, 16, 32, 64, 128\) for the Pallas kernel"),
}


@pytest.fixture(scope="module")
def good_expected(hf_tiny):
    return hf_greedy(hf_tiny[0], GOOD, 32)


def _serves_good_request(llm, expected):
    assert_pool_clean(llm.llm_engine)
    out = llm.generate([ids(GOOD)], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected
    assert_pool_clean(llm.llm_engine)


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_refused_then_engine_serves(llm_ref, good_expected, case):
    call, message = BAD_REQUESTS[case]
    with pytest.raises(ValueError, match=message):
        call(llm_ref)
    _serves_good_request(llm_ref, good_expected)


@pytest.mark.parametrize("case", list(BAD_ENGINES))
def test_bad_engine_refused(llm_ref, good_expected, tmp_path, case):
    build, exc, message = BAD_ENGINES[case]
    with pytest.raises(exc, match=message):
        build(tmp_path)
    _serves_good_request(llm_ref, good_expected)


# -- streaming, stop strings, interrupts, non-finite logits ------------------------------------------------
def test_stream_yields_tokens_as_produced(llm_ref):
    prompts = prompts_of(np.random.default_rng(400), [4, 30, 12])
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = {i: r.outputs[0].token_ids
                for i, r in enumerate(llm_ref.generate([ids(p) for p in prompts], sp, use_tqdm=False))}
    events = [(o.request_id, c.index, c.token_ids, o.finished) for o in llm_ref.stream([ids(p) for p in prompts], sp)
              for c in o.outputs]
    rids = list(dict.fromkeys(e[0] for e in events))
    assert len(rids) == 3
    got = {i: [t for rid, idx, new, _ in events if rid == r for t in new] for i, r in enumerate(rids)}
    assert got == expected
    assert all(len(new) == 1 and idx == 0 for _, idx, new, _ in events)  # one token per step, as produced
    assert [e[3] for e in events if e[0] == rids[0]] == [False] * 5 + [True]  # the last delta says finished
    # incremental: the requests' tokens interleave rather than arriving request by request
    first = {r: next(i for i, e in enumerate(events) if e[0] == r) for r in rids}
    last = {r: max(i for i, e in enumerate(events) if e[0] == r) for r in rids}
    assert max(first.values()) < min(last.values())
    assert_pool_clean(llm_ref.llm_engine)


def test_stop_string_ends_generation(crowd_llm):
    assert isinstance(crowd_llm.tokenizer, ByteTokenizer)
    sp = dict(temperature=1.0, seed=77, max_tokens=40, ignore_eos=True)
    full = crowd_llm.generate(["The prompt "], SamplingParams(**sp), use_tqdm=False)[0].outputs[0]
    tok = ByteTokenizer()
    # the first ASCII letter or digit the model emits after its third token becomes the stop string
    k = next(i for i, t in enumerate(full.token_ids) if i >= 3 and 0 <= t - tok.offset < 128
             and chr(t - tok.offset).isalnum() and chr(t - tok.offset) not in tok.decode(full.token_ids[:i]))
    stop = chr(full.token_ids[k] - tok.offset)
    out = crowd_llm.generate(["The prompt "], SamplingParams(**sp, stop=[stop, "\x00never"]),
                             use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[:k + 1]  # generation ended at the token completing it
    assert out.text == full.text[:full.text.index(stop)]  # the stop string itself is not returned
    assert_pool_clean(crowd_llm.llm_engine)


@pytest.mark.parametrize("when", ["before", "after", "fetch"])
def test_keyboard_interrupt_in_step_leaves_engine_usable(llm_ref, monkeypatch, when):
    """A KeyboardInterrupt raised inside a step (before the device step started, after it started
    but before it was counted, or while waiting for its tokens): stepping on gives exactly the
    uninterrupted tokens; under LLM.generate the call's requests are aborted and the pool is
    whole again."""
    eng = llm_ref.llm_engine
    prompts = [ids(p) for p in prompts_of(np.random.default_rng({"before": 500, "after": 501, "fetch": 502}[when]),
                                          [9, 40, 3])]
    sp = SamplingParams(temperature=0, max_tokens=10)
    expected = [r.outputs[0].token_ids for r in llm_ref.generate(prompts, sp, use_tqdm=False)]
    name = "fetch" if when == "fetch" else "dispatch"
    real = getattr(eng.runner, name)
    calls = {"n": 0}

    def execute(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the 40-token prompt's second chunk, the 3-token prompt and a decode
            if when != "before":
                real(*args, **kwargs)
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(eng.runner, name, execute)
    # 1. driving the engine directly: the interrupted step is rolled back and scheduled again
    rids = [eng.add_request(None, p, sp) for p in prompts]
    done = {}
    with pytest.raises(KeyboardInterrupt):
        while eng.has_unfinished_requests():
            eng.step()
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[r] for r in rids] == expected
    assert_pool_clean(eng)
    # 2. under LLM.generate: the interrupt propagates, the call's requests are aborted
    calls["n"] = 0
    with pytest.raises(KeyboardInterrupt):
        llm_ref.generate(prompts, sp, use_tqdm=False)
    assert_pool_clean(eng)
    assert [r.outputs[0].token_ids for r in llm_ref.generate(prompts, sp, use_tqdm=False)] == expected


def test_nonfinite_logits_end_only_that_request(crowd_llm):
    rng = np.random.default_rng(600)
    prompts = [ids(p) for p in prompts_of(rng, [6, 20, 9], hi=384)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = [r.outputs[0].token_ids for r in crowd_llm.generate(prompts, greedy, use_tqdm=False)]
    poisoned = SamplingParams(temperature=1.0, seed=666, max_tokens=8)
    results = crowd_llm.generate(prompts[:1] + [ids(list(range(100, 113)))] + prompts[1:],
                                 [greedy, poisoned, greedy, greedy], use_tqdm=False)
    bad = results[1].outputs[0]
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert [r.outputs[0].token_ids for r in results[:1] + results[2:]] == alone
    assert all(r.outputs[0].finish_reason == "length" for r in results[:1] + results[2:])
    assert_pool_clean(crowd_llm.llm_engine)


def test_generated_ids_skip_ids_a_caller_already_uses(llm_ref):
    eng = llm_ref.llm_engine
    prompt = prompts_of(np.random.default_rng(400), [5])[0]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    taken = str(eng._counter)                    # the number the engine would hand out next
    assert eng.add_request(taken, ids(prompt), sp) == taken
    auto = eng.add_request(None, ids(prompt), sp)
    assert auto != taken
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert set(done) == {taken, auto}
    assert done[taken].outputs[0].token_ids == done[auto].outputs[0].token_ids
    assert_pool_clean(eng)


def test_abort_request_takes_several_ids_and_ignores_unknown_ones(llm_ref):
    # vLLM's LLMEngine.abort_request: one id or an iterable of them; ids of requests that have
    # finished, or never existed, are ignored
    eng = llm_ref.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = prompts_of(np.random.default_rng(401), [4, 6, 5])
    a, b, c = (eng.add_request(None, ids(p), sp) for p in prompts)
    eng.step()
    eng.abort_request([a, b, "no-such-id"])
    eng.abort_request("no-such-id")
    assert eng.get_num_unfinished_requests() == 1
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert set(done) == {c} and len(done[c].outputs[0].token_ids) == 20
    eng.abort_request(c)  # finished already: nothing happens
    assert_pool_clean(eng)


def test_engine_on_preloaded_weights_equals_engine_by_name():
    from pagedjax.model.hub import LoadedModel, load_any_model

    loaded = load_any_model("tiny-random", jnp.float32, 0)
    assert isinstance(loaded, LoadedModel)
    kw = dict(max_num_seqs=4, max_model_len=64, num_blocks=32)
    prompt = {"prompt_token_ids": [5, 9, 13, 200, 7]}
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    by_name = LLM("tiny-random", **kw).generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    preloaded = LLM(loaded, **kw).generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert preloaded == by_name
