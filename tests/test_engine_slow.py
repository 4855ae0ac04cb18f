"""The real default model end to end: SmolLM2-135M-Instruct from its GGUF, through `LLM.chat`,
against Hugging Face `generate` on the same GGUF. Slow (two loads of the model, a few compiles of
a 30-layer step, 32 batched HF decode steps): `-m 'not slow'` skips it, CI runs it."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 11?",
]


def test_smollm2_chat_greedy_matches_hf_generate():
    import torch
    from transformers import AutoModelForCausalLM

    from pagedjax import LLM, SamplingParams, native
    from pagedjax.model.hub import default_model_path

    gguf = default_model_path()  # downloads once into ~/.cache/pagedjax
    # 8 seats, a 128-token step budget (the ~300 prompt tokens are prefilled in chunks beside decodes)
    llm = LLM("smollm2-135m", max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256)
    if native.matmul_available() and native.packing_enabled():
        # the GGUF's Q4_1 projections and Q8_0 embedding are multiplied from their packed forms
        held = llm.llm_engine.runner.step_params
        assert {w.kind for lp in held["layers"] for w in lp.values() if isinstance(w, native.Panels)} == {"q4"}
        assert held["head"].kind == "q8"
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)

    tok = llm.tokenizer
    prompts = []
    for conv, out in zip(convs, outs):
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        assert out.prompt_token_ids == ids  # the engine tokenized the template as HF does (no extra BOS)
        prompts.append(ids)
    # HF: one batch, left padded, with its attention mask (HF derives positions from it). One prompt
    # at a time would avoid padding, but costs 8x the HF time on a 2-core machine; padding only
    # reorders float sums, far below the engine's own ~1e-5 distance from HF.
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        gen = hf.generate(input_ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=pad)
    eos = set(llm.llm_engine.eos_token_ids)
    for conv, out, row in zip(convs, outs, gen[:, width:].tolist()):
        # rows that ended early are padded after their eos
        expected = row[:next((i + 1 for i, t in enumerate(row) if t in eos), len(row))]
        got = out.outputs[0]
        assert got.token_ids == expected, f"{conv[0]['content']!r}: {got.text!r} vs {tok.decode(expected)!r}"
        assert got.finish_reason == ("stop" if expected[-1] in eos else "length")
        assert got.text == tok.decode(expected, skip_special_tokens=True)
    assert outs[0].outputs[0].text.startswith("The capital of France is Paris")
