"""Shared pieces of the engine tests: a tiny random HF Llama, HF references, pool checks."""

from __future__ import annotations

import contextlib

import numpy as np

# a few layers, GQA (4 query heads over 2 kv heads), an untied head, a vocab of a few hundred
TINY_HF = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_theta=10000.0, tie_word_embeddings=False)

# small buckets: warm-up and on-demand compiles stay few (T in {16, 32}, P in {4, 8, 16})
SMALL = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, block_size=8)


def make_tiny_hf(seed: int = 0):
    """A random transformers LlamaForCausalLM with weights spread wider than HF's default init
    (std 0.02 and unit norms give nearly flat logits, so greedy outputs would degenerate into
    one repeated token and near-ties would make the comparison fragile)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY_HF)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy continuation of one prompt (stops at eos like ours; no padding involved)."""
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_beam(hf, prompt: list[int], num_beams: int, max_new_tokens: int) -> list[tuple[list[int], float]]:
    """HF beam search run to a fixed length: eos_token_id=None makes eos an ordinary token, as
    ignore_eos does for ours. Returns every final beam, best first: (new tokens, score = sum of
    logprobs / length ** length_penalty)."""
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), num_beams=num_beams, do_sample=False, length_penalty=1.0,
                          early_stopping=True, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
                          num_return_sequences=num_beams, return_dict_in_generate=True, output_scores=True)
    return [(out.sequences[i, len(prompt):].tolist(), float(out.sequences_scores[i])) for i in range(num_beams)]


def hf_logprobs(hf, tokens: list[int]) -> np.ndarray:
    """log_softmax of HF's logits at every position of `tokens`: [len, vocab]."""
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def ids(prompt: list[int]) -> dict:
    return {"prompt_token_ids": list(prompt)}


@contextlib.contextmanager
def recording_schedules(eng):
    """Record every SchedulerOutput the engine's scheduler produces while inside."""
    outs = []
    orig = eng.scheduler.schedule

    def schedule():
        out = orig()
        outs.append(out)
        return out

    eng.scheduler.schedule = schedule
    try:
        yield outs
    finally:
        del eng.scheduler.schedule  # back to the class method


def num_chunked_rows(outs) -> int:
    """Prefill chunks that stopped short of their prompt's end (no token sampled)."""
    return sum(1 for o in outs for need in o.needs_sample if not need)


def assert_pool_clean(eng) -> None:
    """Nothing in flight, every block free (cached ones with refcount 0), seats and host pool whole."""
    sched, kv = eng.scheduler, eng.scheduler.kv
    assert not eng.has_unfinished_requests() and not sched.requests
    assert not sched.running and not sched.waiting and not sched.swapped
    assert not kv.req_to_blocks and not kv.swapped and not kv.num_tokens_held
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - 1
    assert all(c == 0 for c in kv.pool.ref_cnt)
    assert kv.host.num_free_blocks == kv.host.num_blocks and all(c == 0 for c in kv.host.ref_cnt)
    assert kv.usage().real_tokens == 0 and kv.usage().used_blocks == 0
    assert len(sched._free_seats) == eng.config.max_num_seqs and not sched.seats
