"""vLLM's logits processors: penalties against numpy and transformers, the host packing of biases
and bans, and their effect on the engine's tokens (greedy parity with transformers' repetition
penalty, allowed ids, logit bias, bad words, min_tokens, raw logprobs).

Batch invariance with processors among 31 other rows and zero compilations across a 2,000-step
churn of random mixes are pinned in test_engine.py."""

from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import SMALL, hf_logprobs, ids, make_tiny_hf
from pagedjax import LLM, SamplingParams
from pagedjax.logits_processors import apply_logits_processors
from pagedjax.scheduler.logits_inputs import LogitsInputs, LogitsPacker
from pagedjax.scheduler.output import SchedulerOutput
from pagedjax.scheduler.sequence import Request


def penalties_numpy(logits, tokens, prompt_len, repetition, frequency, presence):
    """vLLM's definitions, one row at a time, in plain numpy."""
    out = logits.astype(np.float64).copy()
    prompt, output = tokens[:prompt_len], tokens[prompt_len:]
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):
        out[t] -= frequency * output.count(t) + presence
    return out


def random_inputs(rng, S=5, V=50, L=24):
    li = LogitsInputs.neutral(S, V, L)
    rows = []
    for s in range(S):
        n = int(rng.integers(0, L + 1)) if s else 0  # row 0: no penalties
        toks = rng.integers(0, V, n).tolist()
        p = int(rng.integers(0, n + 1))
        rep, freq, pres = (1.0, 0.0, 0.0) if s == 0 else (float(rng.uniform(0.5, 2)), float(rng.uniform(-2, 2)),
                                                           float(rng.uniform(-2, 2)))
        li.token_ids[s, :n] = toks
        li.lens[s], li.prompt_lens[s] = n, p
        li.repetition_penalty[s], li.frequency_penalty[s], li.presence_penalty[s] = rep, freq, pres
        rows.append((toks, p, rep, freq, pres))
    return li, rows


def test_penalties_match_numpy_definitions():
    rng = np.random.default_rng(0)
    for _ in range(5):
        li, rows = random_inputs(rng)
        logits = rng.normal(0, 3, li.bias.shape).astype(np.float32)
        got = np.asarray(apply_logits_processors(logits, li))
        for s, (toks, p, rep, freq, pres) in enumerate(rows):
            np.testing.assert_allclose(got[s], penalties_numpy(logits[s], toks, p, rep, freq, pres), rtol=1e-5,
                                       atol=1e-5)
        np.testing.assert_array_equal(got[0], logits[0])  # a row without penalties is untouched


def test_bias_is_added_before_the_penalties_and_bans_stay_banned():
    rng = np.random.default_rng(1)
    li, rows = random_inputs(rng, S=3)
    logits = rng.normal(0, 3, li.bias.shape).astype(np.float32)
    li.bias[1, 7] = 4.0
    li.bias[2, :] = -np.inf
    li.bias[2, 3] = 0.0
    got = np.asarray(apply_logits_processors(logits, li))
    toks, p, rep, freq, pres = rows[1]
    biased = logits[1].copy()
    biased[7] += 4.0
    np.testing.assert_allclose(got[1], penalties_numpy(biased, toks, p, rep, freq, pres), rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.delete(got[2], 3)).all() and np.isfinite(got[2, 3])


def test_repetition_penalty_matches_transformers():
    torch = pytest.importorskip("torch")
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(2)
    V, L = 64, 30
    for penalty in (0.7, 1.3, 2.0):
        li = LogitsInputs.neutral(4, V, L)
        seqs = [rng.integers(0, V, L).tolist() for _ in range(4)]
        for s, toks in enumerate(seqs):
            li.token_ids[s], li.lens[s], li.prompt_lens[s] = toks, L, int(rng.integers(0, L))
        li.repetition_penalty[:] = penalty
        logits = rng.normal(0, 3, (4, V)).astype(np.float32)
        ours = np.asarray(apply_logits_processors(logits, li))
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor(seqs), torch.tensor(logits)).numpy()
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)


# -- the host side ------------------------------------------------------------------------------------
def request(rid, prompt, sp, outputs=(), bad_words=None, eos=2):
    req = Request(rid, list(prompt), sp, eos_token_id=eos, bad_words_token_ids=bad_words)
    for t in outputs:
        req.append_output_token(t, 0.0)
    return req


def schedule_of(*reqs):
    return SchedulerOutput(step=0, scheduled=list(reqs), num_new_tokens=[1] * len(reqs),
                           sample_from=list(range(len(reqs))))


def test_packer_bans_and_biases_per_row_and_clears_them_next_step():
    packer = LogitsPacker(vocab_size=20, max_model_len=16)
    plain = request("plain", [5, 6], SamplingParams())
    assert packer.pack(schedule_of(plain), 4) is None  # nothing to do: the step runs as without processors
    # bad words: [9] always banned; [4, 8] banned after a 4; [3, 4, 8] needs [3, 4] at the end of the output
    words = request("words", [5], SamplingParams(bad_words=["x"]), outputs=[3, 4], bad_words=[[9], [4, 8], [3, 4, 7],
                                                                                                [1, 4, 6]])
    early = request("early", [5], SamplingParams(min_tokens=3, stop_token_ids=[11]), outputs=[10])
    late = request("late", [5], SamplingParams(min_tokens=1, stop_token_ids=[11]), outputs=[10])
    allowed = request("allowed", [5], SamplingParams(allowed_token_ids=[1, 2], logit_bias={2: 1.5, 3: 7.0}))
    pen = request("pen", [5, 6, 6], SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5), outputs=[6, 7])
    li = packer.pack(schedule_of(plain, words, early, late, allowed, pen), 8)
    banned = {s: set(np.flatnonzero(np.isneginf(li.bias[s])).tolist()) for s in range(6)}
    assert banned[0] == set() and not li.bias[0].any()
    assert banned[1] == {9, 8, 7}
    assert banned[2] == {2, 11}          # EOS and stop ids, before min_tokens
    assert banned[3] == set()
    assert banned[4] == set(range(20)) - {1, 2} and li.bias[4, 2] == 1.5 and li.bias[4, 1] == 0.0
    assert li.lens.tolist() == [0, 0, 0, 0, 0, 5, 0, 0] and li.prompt_lens[5] == 3
    assert li.token_ids[5, :5].tolist() == [5, 6, 6, 6, 7]
    assert li.repetition_penalty[5] == 1.5 and li.frequency_penalty[5] == 0.5 and li.repetition_penalty[0] == 1.0
    # next step, other rows in those places: yesterday's bans are gone
    pen.append_output_token(9, 0.0)
    li = packer.pack(schedule_of(pen, plain, plain, plain, plain, plain), 8)
    assert not li.bias.any() and li.lens.tolist() == [6, 0, 0, 0, 0, 0, 0, 0]
    assert li.token_ids[0, :6].tolist() == [5, 6, 6, 6, 7, 9]


# -- the engine ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    hf = make_tiny_hf()
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def llm_hf(hf_tiny):
    return LLM(str(hf_tiny[1]), attention_backend="reference", **SMALL)


@pytest.fixture(scope="module")
def llm_bytes():
    """tiny-random: a byte-level tokenizer, so words are their letters."""
    return LLM("tiny-random", **SMALL)


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_greedy_with_repetition_penalty_equals_transformers(hf_tiny, llm_hf, penalty):
    import torch

    hf, _ = hf_tiny
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 300, n).tolist() for n in (4, 11, 23)]
    sp = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=penalty)
    ours = [r.outputs[0].token_ids for r in llm_hf.generate([ids(p) for p in prompts], sp, use_tqdm=False)]
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                              repetition_penalty=penalty)[0, len(prompt):].tolist()
        assert got == ref
    plain = llm_hf.generate([ids(prompts[0])], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert plain[0].outputs[0].token_ids != ours[0]  # the penalty changed something


def test_allowed_ids_and_logit_bias_steer_tokens_while_logprobs_stay_the_models(hf_tiny, llm_hf):
    prompt = list(range(10, 22))
    allowed = [50, 60, 70]
    out = llm_hf.generate([ids(prompt)], SamplingParams(temperature=0.9, seed=3, max_tokens=12,
                                                         allowed_token_ids=allowed), use_tqdm=False)[0]
    assert set(out.outputs[0].token_ids) <= set(allowed)
    forced = llm_hf.generate([ids(prompt)], SamplingParams(temperature=0, max_tokens=3, logit_bias={77: 100},
                                                           logprobs=2), use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == [77, 77, 77]
    # the logprob returned is the model's own, before the bias, as vLLM returns it
    raw = hf_logprobs(hf_tiny[0], prompt + [77, 77])
    for i, lp in enumerate(forced.logprobs):
        assert lp[77].logprob == pytest.approx(raw[len(prompt) - 1 + i, 77], abs=1e-4)
        assert lp[77].rank == 1 + int((raw[len(prompt) - 1 + i] > raw[len(prompt) - 1 + i, 77]).sum())


def test_bad_words_are_never_completed(llm_bytes):
    tok = llm_bytes.get_tokenizer()
    prompt = "abababababababab"
    plain = llm_bytes.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    word = plain.text[1:3]  # two bytes the model writes greedily
    assert word in plain.text
    out = llm_bytes.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                      bad_words=[word]), use_tqdm=False)[0].outputs[0]
    assert word not in out.text and out.text != plain.text
    assert tok.encode(word, add_special_tokens=False) == [ord(c) + 3 for c in word]


def test_min_tokens_bans_eos_until_reached(llm_bytes):
    eos = 2
    sp = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100})  # eos whenever allowed
    assert llm_bytes.generate(["hi"], sp, use_tqdm=False)[0].outputs[0].token_ids == [eos]
    out = llm_bytes.generate(["hi"], sp.replace(min_tokens=6), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 7 and out.token_ids[-1] == eos and eos not in out.token_ids[:6]
    assert out.finish_reason == "stop"
    stop = llm_bytes.generate(["hi"], SamplingParams(temperature=0, max_tokens=20, logit_bias={40: 100},
                                                     stop_token_ids=[40], min_tokens=4), use_tqdm=False)[0].outputs[0]
    assert len(stop.token_ids) == 5 and stop.token_ids[-1] == 40 and 40 not in stop.token_ids[:4]


def test_bad_words_need_a_tokenizer(llm_hf):
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        llm_hf.generate([ids([5, 6])], SamplingParams(bad_words=["x"]), use_tqdm=False)
