"""Async scheduling: the host schedules and packs step N+1 while step N runs, N+1 reading N's
sampled tokens on the device. It must change when tokens come back, never which tokens: the
same outputs as the synchronous engine (greedy and seeded sampling, n > 1, stop tokens,
logprobs) through recompute and swap preemption, aborts in flight and lost steps, with nothing
compiled after warm-up; steps whose rows need their tokens on the host run synchronously."""

from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import SMALL, assert_pool_clean, ids
from pagedjax import LLM, BeamSearchParams, SamplingParams

VOCAB = 256


def make(mode: str, async_scheduling: bool) -> LLM:
    if mode == "swap":
        kw = dict(preemption_mode="swap", token_buckets=(32,), page_buckets=(16,))
    else:
        kw = dict(token_buckets=(16, 32), page_buckets=(8, 16))
    llm = LLM("tiny-random", num_blocks=20, async_scheduling=async_scheduling, **kw, **SMALL)
    llm.warmup()
    return llm


@pytest.fixture(scope="module")
def engines():
    built = {}

    def get(mode="recompute"):
        if mode not in built:
            built[mode] = make(mode, False), make(mode, True)
        return built[mode]

    return get


def workload(seed: int, n: int = 14):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, VOCAB, int(k)).tolist() for k in rng.integers(2, 50, n)]
    params = [SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i, max_tokens=int(rng.integers(1, 40)),
                             n=2 if i % 4 == 1 else 1, stop_token_ids=[7, 11, 13] if i % 3 == 0 else None,
                             logprobs=2 if i % 5 == 0 else None)
              for i in range(n)]
    return prompts, params


def summary(outputs, tolerance=None):
    """Each output's completions as (tokens, finish reason, sampled-token logprobs). With a
    tolerance the logprobs compare approximately: the two engines can batch a row differently
    (preemption lands on other steps), which moves a logprob in its last float bits."""
    def logprobs(c):
        lps = [next(iter(d.values())).logprob for d in (c.logprobs or [])]
        return lps if tolerance is None else pytest.approx(lps, abs=tolerance)

    return [[(list(c.token_ids), c.finish_reason, logprobs(c)) for c in o.outputs] for o in outputs]


def expected(outputs):
    """The synchronous engine's outputs, as what the async engine's `summary` must equal."""
    return summary(outputs, tolerance=1e-4)


def drive(llm, prompts, params, on_step=None):
    """Step the engine by hand until done; {request index: output}, and how many steps returned
    with a step left running."""
    eng = llm.llm_engine
    rids = [eng.add_request(None, ids(p), sp) for p, sp in zip(prompts, params)]
    done, in_flight, k = {}, 0, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[rids.index(out.request_id)] = out
        in_flight += eng.step_in_flight
        k += 1
        if on_step is not None:
            on_step(k, eng, rids)
    return [done.get(i) for i in range(len(rids))], in_flight


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_gives_the_synchronous_tokens_through_preemption(engines, mode):
    sync, asyn = engines(mode)
    prompts, params = workload(1)
    want = expected(sync.generate([ids(p) for p in prompts], params, use_tqdm=False))
    before = asyn.llm_engine.num_compilations
    got, in_flight = drive(asyn, prompts, params)
    assert summary(got) == want
    assert in_flight > 20  # it really overlapped
    assert sync.llm_engine.scheduler.num_preemptions > 0 and asyn.llm_engine.scheduler.num_preemptions > 0
    assert asyn.llm_engine.num_compilations == before
    assert_pool_clean(asyn.llm_engine)
    # LLM.generate drives it the same way
    assert summary(asyn.generate([ids(p) for p in prompts], params, use_tqdm=False)) == want
    assert_pool_clean(asyn.llm_engine)


def test_abort_while_a_step_is_in_flight(engines):
    sync, asyn = engines()
    prompts, params = workload(2, n=6)
    params = [SamplingParams(temperature=sp.temperature, seed=sp.seed, max_tokens=30, ignore_eos=True) for sp in params]
    want = expected(sync.generate([ids(p) for p in prompts], params, use_tqdm=False))

    def abort_third(k, eng, rids):
        if k == 12:
            assert eng.step_in_flight
            eng.abort_request(rids[2])

    got, _ = drive(asyn, prompts, params, abort_third)
    assert got.pop(2) is None  # an aborted request reports nothing more, as in vLLM
    del want[2]
    assert summary(got) == want
    assert_pool_clean(asyn.llm_engine)


def test_rows_that_need_host_tokens_run_synchronously(engines):
    """Penalties read the tokens so far on the host, and a beam search picks each token before
    the next step reads it: with such a request in the engine, no step is left in flight."""
    sync, asyn = engines()
    prompts, params = workload(3, n=6)
    params[1] = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.5, presence_penalty=0.5)
    want = expected(sync.generate([ids(p) for p in prompts], params, use_tqdm=False))
    got, in_flight = drive(asyn, prompts[1:2], params[1:2])
    assert summary(got) == want[1:2] and in_flight == 0
    got, _ = drive(asyn, prompts, params)
    assert summary(got) == want
    beam = BeamSearchParams(beam_width=2, max_tokens=8)
    assert [s.tokens for s in asyn.beam_search([ids(prompts[0])], beam)[0].sequences] == \
        [s.tokens for s in sync.beam_search([ids(prompts[0])], beam)[0].sequences]
    assert_pool_clean(asyn.llm_engine)


@pytest.mark.parametrize("where", ["dispatch", "fetch"])
def test_a_lost_step_is_recomputed(engines, monkeypatch, where):
    """A KeyboardInterrupt while starting a step (it is rolled back) or while waiting for its
    tokens (its requests, and those of the step that read them, are recomputed): stepping on
    gives exactly the uninterrupted tokens."""
    sync, asyn = engines()
    prompts, params = workload(4, n=6)
    want = expected(sync.generate([ids(p) for p in prompts], params, use_tqdm=False))
    eng = asyn.llm_engine
    real = getattr(eng.runner, where)
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 9:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(eng.runner, where, flaky)
    rids = [eng.add_request(None, ids(p), sp) for p, sp in zip(prompts, params)]
    done = {}

    def run():
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[rids.index(out.request_id)] = out

    with pytest.raises(KeyboardInterrupt):
        run()
    run()
    assert summary([done[i] for i in range(len(rids))]) == want
    assert_pool_clean(eng)
