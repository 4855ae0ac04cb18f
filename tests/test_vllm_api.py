"""A vLLM user's script, as such a user writes it: the imports name `pagedjax` where the script
would name `vllm` (the same module paths), and MODEL names a model pagedjax has built in. Nothing
else here is pagedjax's own: every call, field and idiom below is vLLM's offline API.

Each block pins one habit: generate with one or many SamplingParams, n samples with seeds, stop
strings and ids, logprobs as Logprob objects, prompt logprobs, TokensPrompt/TextPrompt, chat with
content parts, the engine loop with DELTA outputs, abort, penalties and bans, beam search, and
the metrics object."""

from __future__ import annotations

import pytest

from pagedjax import LLM, EngineArgs, LLMEngine, SamplingParams
from pagedjax.inputs import TextPrompt, TokensPrompt
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.sampling_params import BeamSearchParams, RequestOutputKind

MODEL = "tiny-random"   # a vLLM run names its model here (the tiny one: random weights, byte tokenizer)


@pytest.fixture(scope="module")
def llm():
    return LLM(model=MODEL, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, seed=0)


def test_generate_like_the_quickstart(llm):
    prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, seed=0)
    outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    for output in outputs:
        assert isinstance(output, RequestOutput) and output.finished
        completion = output.outputs[0]
        assert isinstance(completion, CompletionOutput)
        generated_text = completion.text
        assert isinstance(generated_text, str) and len(completion.token_ids) <= 16  # max_tokens defaults to 16
        assert completion.finish_reason in ("stop", "length")
    again = llm.generate(prompts, sampling_params, use_tqdm=False)
    assert [o.outputs[0].text for o in again] == [o.outputs[0].text for o in outputs]  # seeded


def test_one_sampling_params_per_prompt_and_n_samples(llm):
    params = [SamplingParams(temperature=0, max_tokens=5),
              SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=7, ignore_eos=True)]
    greedy, sampled = llm.generate(["abc", "xyz"], params, use_tqdm=False)
    assert len(greedy.outputs) == 1 and len(sampled.outputs) == 3
    assert [c.index for c in sampled.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 7 for c in sampled.outputs)
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1


def test_max_tokens_none_runs_to_max_model_len(llm):
    out = llm.generate("tell me a story", SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 128
    assert out.outputs[0].finish_reason == "length"


def test_stop_strings_and_stop_token_ids(llm):
    tokenizer = llm.get_tokenizer()
    free = llm.generate("once upon", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = free.text[5:7]
    cut = llm.generate("once upon", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert stop not in cut.text and free.text.startswith(cut.text)
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate("once upon", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop,
                                                    include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text.endswith(stop)
    stop_id = tokenizer.encode(free.text[3], add_special_tokens=False)[0]
    by_id = llm.generate("once upon", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                     stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids[-1] == stop_id and by_id.stop_reason == stop_id and by_id.finish_reason == "stop"


def test_logprobs_and_prompt_logprobs(llm):
    out = llm.generate(["The sky is"], SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=1),
                       use_tqdm=False)[0]
    completion = out.outputs[0]
    total = 0.0
    for token_id, top in zip(completion.token_ids, completion.logprobs):
        logprob = top[token_id]
        assert logprob.rank == 1 and logprob.logprob <= 0 and isinstance(logprob.decoded_token, str)
        assert len(top) == 3 and sorted(lp.rank for lp in top.values()) == [1, 2, 3]
        total += logprob.logprob
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token_id, top in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token_id in top and top[token_id].rank >= 1


def test_token_and_text_prompts(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("same prompt")
    sp = SamplingParams(temperature=0, max_tokens=6)
    a, b = llm.generate([TokensPrompt(prompt_token_ids=ids), TextPrompt(prompt="same prompt")], sp, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.prompt_token_ids == ids


def test_chat_with_content_parts(llm):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    plain = llm.chat([messages[0], {"role": "user", "content": "Hi\nthere"}], SamplingParams(temperature=0, max_tokens=5),
                     use_tqdm=False)[0]
    assert out.prompt == plain.prompt and out.outputs[0].text == plain.outputs[0].text
    assert "[{" not in out.prompt  # the parts' texts, not their repr
    both = llm.chat([messages, messages], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert len(both) == 2


def test_engine_loop_with_delta_outputs_and_abort(llm):
    engine = llm.llm_engine
    engine.add_request("story", TextPrompt(prompt="In a hole in the ground"),
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA))
    engine.add_request("gone-1", "abort me", SamplingParams(max_tokens=50))
    engine.add_request("gone-2", "and me", SamplingParams(max_tokens=50))
    engine.abort_request(["gone-1", "gone-2", "never-existed"])
    pieces, ids = [], []
    while engine.has_unfinished_requests():
        for request_output in engine.step():
            assert request_output.request_id == "story"
            pieces.append(request_output.outputs[0].text)
            ids += request_output.outputs[0].token_ids
    whole = llm.generate("In a hole in the ground", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert "".join(pieces) == whole.text and ids == whole.token_ids and len(pieces) > 1


def test_params_are_plain_objects(llm):
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    copy = sp.clone()
    copy.max_tokens = 3
    assert sp.max_tokens == 20
    text = llm.generate("abc", sp, use_tqdm=False)[0].outputs[0].text
    sp.stop = [text[4:6]]
    assert text[4:6] not in llm.generate("abc", sp, use_tqdm=False)[0].outputs[0].text
    with pytest.raises(ValueError, match="temperature"):
        sp.temperature = -1


def test_penalties_and_bans(llm):
    sp = SamplingParams(temperature=0.7, seed=1, max_tokens=16, repetition_penalty=1.2, presence_penalty=0.5,
                        frequency_penalty=0.5, min_tokens=4, logit_bias={65: 2.0}, bad_words=["zz"],
                        allowed_token_ids=list(range(60, 200)))
    out = llm.generate("penalised", sp, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 4 and all(60 <= t < 200 for t in out.token_ids) and "zz" not in out.text


def test_beam_search(llm):
    outputs = llm.beam_search([{"prompt": "The best"}], BeamSearchParams(beam_width=2, max_tokens=5))
    best = outputs[0].sequences[0]
    assert best.text.startswith("The best") and len(outputs[0].sequences) == 2


def test_request_metrics(llm):
    out = llm.generate("timing", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    m = out.metrics
    assert m.num_generation_tokens == 4
    assert m.arrival_time <= m.first_token_ts <= m.last_token_ts and m.first_token_latency >= 0


def test_engine_from_engine_args():
    engine = LLMEngine.from_engine_args(EngineArgs(model=MODEL, max_model_len=64, max_num_seqs=4,
                                                   max_num_batched_tokens=32, enforce_eager=True))
    engine.add_request("0", "hello", SamplingParams(temperature=0, max_tokens=3))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["0"] and len(finished[0].outputs[0].token_ids) == 3
