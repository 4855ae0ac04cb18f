"""The bad-input table: every public entry point turns bad input away at the door.

Entry points: the LLM constructor (EngineConfig knobs, the model and the pool), LLM.generate,
SamplingParams, LLMEngine.add_request / abort_request, the kernels' Python boundary
(pagedjax.pallas.paged_attention / ragged_paged_attention) and the loaders (LLM(path),
load_model). Each case asserts the exception's exact type, that its message names the field
(one regex) and its limit (another), and then that the same module-wide engine, its pool whole,
serves good requests exactly as a fresh engine did at setup.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import SMALL, assert_pool_clean, ids, make_tiny_hf
from pagedjax import LLM, SamplingParams
from pagedjax.testing import TINY_RANDOM
from pagedjax.model import load_model
from pagedjax.pallas import paged_attention, ragged_paged_attention

VOCAB = TINY_RANDOM.vocab_size  # 384
# one step bucket: the module's engines compile a single step, shared by every engine of these shapes
KW = dict(SMALL, token_buckets=(32,), page_buckets=(16,))  # 8 seats, 32 tokens a step, 128-token sequences, blocks of 8
GOOD = list(range(60, 75))
GREEDY = SamplingParams(temperature=0, max_tokens=12)
GOOD_PROMPTS = [ids(GOOD), "a good prompt"]
GOOD_PARAMS = [GREEDY, SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", **KW)


@pytest.fixture(scope="module")
def reference():
    """The good requests' tokens from a fresh engine of the same model (and compiled step)."""
    outs = LLM("tiny-random", **KW).generate(GOOD_PROMPTS, GOOD_PARAMS, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert [len(t) for t in tokens] == [12, 12] and len(set(tokens[1])) > 6
    return tokens


def serves_good_requests(llm, reference) -> None:
    eng = llm.llm_engine
    assert_pool_clean(eng)
    outs = llm.generate(GOOD_PROMPTS, GOOD_PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_pool_clean(eng)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A good tiny HF Llama directory (config.json + model.safetensors) to spoil copies of."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_hf().save_pretrained(path)  # k_proj [32, 64], up_proj [128, 64]
    return path


@dataclass
class Env:
    llm: LLM
    tmp: Any
    request: Any

    def checkpoint_copy(self):
        return shutil.copytree(self.request.getfixturevalue("checkpoint"), self.tmp / "m")

    def spoiled_checkpoint(self, edit: Callable[[dict], None]):
        from safetensors.numpy import load_file, save_file

        d = self.checkpoint_copy()
        tensors = load_file(d / "model.safetensors")
        edit(tensors)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        return d


@dataclass
class Case:
    name: str
    call: Callable[[Env], Any]
    field: str                 # regex: the message names the field ...
    limit: str                 # ... and its limit
    exc: type = ValueError


CASES: list[Case] = []


def case(name, call, field, limit, exc=ValueError):
    CASES.append(Case(name, call, field, limit, exc))


# -- the LLM constructor ------------------------------------------------------------------------------
def build(**bad):
    return lambda env: LLM("tiny-random", **{**KW, **bad})


case("block_size 0", build(block_size=0), r"\bblock_size\b", r"must be an int >= 1, got 0")
case("num_blocks 1", build(num_blocks=1), r"\bnum_blocks\b", r"must be None or an int >= 2 .*got 1")
case("max_num_seqs 0", build(max_num_seqs=0), r"\bmax_num_seqs\b", r"must be an int >= 1, got 0")
case("max_num_batched_tokens < max_num_seqs", build(max_num_batched_tokens=4), r"^max_num_batched_tokens\b",
     r"must be >= max_num_seqs \(8\).*got 4")
case("max_num_batched_tokens < max_model_len without chunked prefill", build(enable_chunked_prefill=False),
     r"^max_num_batched_tokens\b", r">= max_model_len \(128\) without chunked prefill.*got 32")
case("max_model_len 1", build(max_model_len=1, page_buckets=None), r"\bmax_model_len\b", r"an int >= 2, got 1")
case("max_model_len over the model's positions", build(max_model_len=8192, page_buckets=None),
     r"max_model_len \(8192\)", r"exceeds the model's max_position_embeddings \(4096\)")
case("gpu_memory_utilization 0", build(gpu_memory_utilization=0), r"\bgpu_memory_utilization\b",
     r"must be in \(0, 1\], got 0")
case("num_host_blocks -1", build(num_host_blocks=-1), r"\bnum_host_blocks\b", r"None or >= 0, got -1")
case("token_buckets short of the budget", build(token_buckets=(8, 16)), r"\btoken_buckets\b",
     r"largest size is >= max_num_batched_tokens \(32\)")
case("preemption_mode", build(preemption_mode="drop"), r"\bpreemption_mode\b", r"'recompute' or 'swap', got 'drop'")
case("scheduling", build(scheduling="fifo"), r"\bscheduling\b", r"'continuous' or 'static', got 'fifo'")
case("allocation", build(allocation="buddy"), r"\ballocation\b", r"'paged' or 'contiguous', got 'buddy'")
case("attention_backend", build(attention_backend="flash"), r"\battention_backend\b",
     r"'auto', 'pallas', 'reference', 'native' or 'jnp', got 'flash'")
case("tensor_parallel_size 0", build(tensor_parallel_size=0), r"\btensor_parallel_size\b", r"an int >= 1, got 0")
case("tensor_parallel_size over the devices", lambda env: build(tensor_parallel_size=len(jax.devices()) + 1)(env),
     r"tensor_parallel_size \(\d+\)", r"exceeds the \d+ cpu device\(s\) present")
case("pool too small for one max_model_len request", build(num_blocks=8), r"num_blocks \(8\) leaves 7 usable",
     r"fewer than one max_model_len \(128\) request needs \(16 blocks of 8\)")
case("block_size the Pallas kernel cannot take", build(attention_backend="pallas", block_size=12),
     r"block_size \(12\)", r"must be one of \(8, 16, 32, 64, 128\) for the Pallas kernel")
case("dtype not a float", lambda env: LLM("tiny-random", dtype="int8", **KW), r"^dtype\b",
     r"one of float32, bfloat16, float16, got 'int8'")


# -- generate ----------------------------------------------------------------------------------------
def gen(prompts, params=GREEDY):
    return lambda env: env.llm.generate(prompts, params, use_tqdm=False)


case("prompt of max_model_len tokens", gen([ids([5] * 128)], SamplingParams(temperature=0, max_tokens=1)),
     r"decoder prompt \(length 128\)", r"maximum model length of 128 less the one token it must generate")
case("prompt longer than max_model_len", gen([ids([5] * 129)], SamplingParams(temperature=0, max_tokens=1)),
     r"decoder prompt \(length 129\)", r"maximum model length of 128\b")
case("empty prompt_token_ids", gen([ids([])]), r"prompt_token_ids is empty", r"at least 1 token")
case("empty string prompt", gen([""]), r"prompt is empty", r"at least 1 token")
case("token id = vocab_size", gen([ids([5, VOCAB])]), r"prompt_token_ids",
     rf"ints in \[0, vocab_size={VOCAB}\); got \[{VOCAB}\]")
case("negative token id", gen([ids([-1, 5])]), r"prompt_token_ids", rf"ints in \[0, vocab_size={VOCAB}\); got \[-1\]")
case("float token id", gen([[5.0, 6]]), r"prompt_token_ids", rf"ints in \[0, vocab_size={VOCAB}\); got \[5\.0\]")
case("bad prompt among good ones (the whole call is refused)", gen([ids(GOOD), "fine", ids([VOCAB + 5])]),
     r"prompt_token_ids", rf"vocab_size={VOCAB}\); got \[{VOCAB + 5}\]")
case("more sampling params than prompts", gen([ids(GOOD), ids(GOOD)], [GREEDY] * 3),
     r"sampling_params has 3 entries", r"for 2 prompts: pass one SamplingParams, or a list of exactly 2")
case("logprobs over max_logprobs", gen([ids(GOOD)], SamplingParams(logprobs=21)), r"logprobs \(21\)",
     r"exceeds max_logprobs \(20\)")
case("prompt of another type", gen([ids(GOOD), 42]), r"^prompt must be", r"a string, a token id list or a dict, got int")
case("sampling params of another type", gen([ids(GOOD)], {"temperature": 0}), r"params must be a SamplingParams",
     r"got dict")


# -- SamplingParams (as a caller of generate meets them) -----------------------------------------------
# vLLM's own messages, word for word: a vLLM user's handler that matches them keeps working
SP_BAD = [
    ("n", 0, r"n must be at least 1, got 0\."),
    ("n", 1.5, r"n must be an int, but is of type <class 'float'>"),
    ("n", 2, r"n must be 1 when using greedy sampling, got 2\.", dict(temperature=0)),
    ("temperature", -0.5, r"temperature must be non-negative, got -0\.5\."),
    ("temperature", float("nan"), r"temperature must be a finite number, got nan\."),
    ("temperature", 2.5, r"temperature must be in \[0, 2\], got 2\.5\."),
    ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0\.0\."),
    ("top_p", 1.5, r"top_p must be in \(0, 1\], got 1\.5\."),
    ("top_k", -2, r"top_k must be 0 \(disable\), or at least 1, got -2\."),
    ("top_k", 1.5, r"top_k must be an integer, got float"),
    ("min_p", -0.1, r"min_p must be in \[0, 1\], got -0\.1\."),
    ("min_p", 1.5, r"min_p must be in \[0, 1\], got 1\.5\."),
    ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\], got 2\.5\."),
    ("frequency_penalty", -3.0, r"frequency_penalty must be in \[-2, 2\], got -3\.0\."),
    ("repetition_penalty", 0.0, r"repetition_penalty must be greater than zero, got 0\.0\."),
    ("max_tokens", 0, r"max_tokens must be at least 1, got 0\."),
    ("min_tokens", -1, r"min_tokens must be greater than or equal to 0, got -1\."),
    ("min_tokens", 20, r"min_tokens must be less than or equal to max_tokens=12, got 20\.", dict(max_tokens=12)),
    ("seed", 2**63, r"seed must be None, -1 or an int in \[0, 2\*\*63\), got 9223372036854775808\."),
    ("logprobs", -2, r"logprobs must be non-negative or -1, got -2\."),
    ("prompt_logprobs", -2, r"prompt_logprobs must be non-negative or -1, got -2\."),
    ("stop", "", r"stop cannot contain an empty string\."),
    ("stop", ["ok", None], r"stop must be a string or a list of strings, got \['ok', None\]\."),
    ("stop", ["ok"], r"stop strings are only supported when detokenize is True", dict(detokenize=False)),
    ("stop_token_ids", [7, -3], r"stop_token_ids must be non-negative token ids, got \[7, -3\]\."),
    ("bad_words", ["ok", ""], r"bad_words cannot contain an empty string"),
    ("allowed_token_ids", [], r"allowed_token_ids is not None and empty!"),
    ("logit_bias", {"x": 1.0}, r"logit_bias contains key\(s\) that cannot be converted to integer token IDs"),
    ("truncate_prompt_tokens", 0, r"truncate_prompt_tokens must be >= 1 or -1, got 0"),
]
for field, value, message, *other in SP_BAD:
    case(f"SamplingParams.{field}={value!r}",
         lambda env, f=field, v=value, o=(other or [{}])[0]: env.llm.generate(
             [ids(GOOD)], SamplingParams(**{**o, f: v}), use_tqdm=False),
         rf"^{field}\b", message)


def assigned_after_construction(env):
    sp = SamplingParams(temperature=0, max_tokens=12)
    try:
        sp.top_p = 0.0
    finally:
        assert sp.top_p == 1.0  # refused: the object keeps its checked value
    return env.llm.generate([ids(GOOD)], sp, use_tqdm=False)


case("SamplingParams.top_p assigned after construction", assigned_after_construction, r"^top_p\b",
     r"must be in \(0, 1\], got 0\.0\.")
case("logprobs -1 over max_logprobs", gen([ids(GOOD)], SamplingParams(logprobs=-1)), r"^logprobs \(-1: every token\)",
     r"exceeds max_logprobs \(20\)")
case("prompt_logprobs over max_logprobs", gen([ids(GOOD)], SamplingParams(prompt_logprobs=21)),
     r"^prompt_logprobs \(21\)", r"exceeds max_logprobs \(20\)")
case("allowed_token_ids outside the vocabulary", gen([ids(GOOD)], SamplingParams(allowed_token_ids=[3, VOCAB])),
     r"allowed_token_ids", rf"out of vocabulary \(size {VOCAB}\)")
case("logit_bias outside the vocabulary", gen([ids(GOOD)], SamplingParams(logit_bias={VOCAB + 1: 2.0})),
     r"logit_bias", rf"out of vocabulary \(size {VOCAB}\)")


# -- add_request / abort_request -------------------------------------------------------------------
def duplicate_id(env):
    eng = env.llm.llm_engine
    eng.add_request("dup", ids(GOOD), GREEDY)
    try:
        eng.add_request("dup", ids([7, 8, 9]), GREEDY)
    finally:
        eng.abort_request("dup")  # the first one was accepted: leave the pool whole


def add(request_id, prompt=ids(GOOD), params=GREEDY):
    return lambda env: env.llm.llm_engine.add_request(request_id, prompt, params)


case("add_request: duplicate id", duplicate_id, r"request_id 'dup'", r"already in use by an unfinished request")
case("add_request: '#' in the id", add("a#1"), r"request_id 'a#1'",
     r"must not contain '#': 'id#k' is reserved for sample k")
case("add_request: '~' in the id", add("a~1"), r"request_id 'a~1'",
     r"must not contain '~': 'id~k' is reserved for beam k of a beam search")
case("add_request: n > max_num_seqs", add("wide", params=SamplingParams(n=9)), r"\bn \(9\)",
     r"exceeds max_num_seqs \(8\)")
case("add_request: dict without a prompt", add("d", prompt={"prompt_ids": [5]}), r"prompt dict",
     r"unsupported keys \['prompt_ids'\]: a TextPrompt has 'prompt', a TokensPrompt 'prompt_token_ids'")
case("add_request: dict with neither", add("d", prompt={"cache_salt": "s"}), r"a dict prompt",
     r"needs 'prompt_token_ids' \(TokensPrompt\) or 'prompt' \(TextPrompt\)")
case("add_request: prompt too long", add("long", prompt=ids([5] * 200)), r"decoder prompt \(length 200\)",
     r"maximum model length of 128\b")


# -- the kernels' Python boundary ----------------------------------------------------------------------
def paged(q_heads=4, q_dim=16, kv_heads=2, kv_dim=16, bt_dtype=np.int32):
    """paged_attention on 2 sequences, blocks of 8 tokens, 4 blocks per table."""
    def call(env):
        q = jnp.zeros((2, q_heads, q_dim), jnp.float32)
        k = jnp.zeros((kv_heads, 8, 8, kv_dim), jnp.float32)
        return paged_attention(q, k, k, np.zeros((2, 4), bt_dtype), jnp.array([5, 9], jnp.int32))
    return call


def ragged(q_heads=4, q_dim=16, kv_heads=2, kv_dim=16, bt_dtype=np.int32):
    """ragged_paged_attention: 5 tokens of 2 sequences (3 prefill + 2), blocks of 8 tokens."""
    def call(env):
        q = jnp.zeros((5, q_heads, q_dim), jnp.float32)
        k = jnp.zeros((kv_heads, 8, 8, kv_dim), jnp.float32)
        return ragged_paged_attention(q, k, k, np.zeros((2, 4), bt_dtype), jnp.array([3, 6], jnp.int32),
                                      jnp.array([0, 3, 5], jnp.int32), jnp.int32(2))
    return call


for name, fn in (("paged_attention", paged), ("ragged_paged_attention", ragged)):
    case(f"{name}: head_dim of q and the pages differ", fn(kv_dim=8), r"head_dim mismatch",
         r"q has shape .* \(head_dim 16\) but k_pages has shape .* \(head_dim 8\)")
    case(f"{name}: num_heads % num_kv_heads != 0", fn(q_heads=3), r"num_heads % num_kv_heads != 0",
         r"\(3 heads\) but k_pages has shape .* \(2 kv heads\)")
    case(f"{name}: int64 block tables", fn(bt_dtype=np.int64), r"^block_tables must be int32", r"got int64")


# -- the loaders -----------------------------------------------------------------------------------------
def unsupported_architecture(env):
    d = env.checkpoint_copy()
    config = json.loads((d / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (d / "config.json").write_text(json.dumps(config))
    return LLM(str(d), **KW)


def wrong_shape(env):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((48, 64), np.float32)
    return LLM(str(env.spoiled_checkpoint(edit)), **KW)


def missing_tensor(env):
    return load_model(env.spoiled_checkpoint(lambda t: t.pop("model.layers.1.mlp.up_proj.weight")))


def no_config(env):
    d = env.checkpoint_copy()
    (d / "config.json").unlink()
    return LLM(str(d), **KW)


def not_gguf(env):
    f = env.tmp / "model.bin"
    f.write_bytes(b"x")
    return LLM(str(f), **KW)


case("missing model path", lambda env: LLM(str(env.tmp / "no-such-model"), **KW), r"model path",
     r"does not exist: .*no-such-model$", FileNotFoundError)
case("directory without config.json", no_config, r"config\.json", r"^no config\.json in model directory",
     FileNotFoundError)
case("a file that is not .gguf", not_gguf, r"model path .*model\.bin", r"is a file but not a \.gguf")
case("unsupported architecture", unsupported_architecture, r"architectures=\['GPT2LMHeadModel'\]",
     r"supported architectures: LlamaForCausalLM")
case("tensor shape disagrees with the config", wrong_shape, r"tensor model\.layers\.0\.self_attn\.k_proj\.weight",
     r"expected shape \(32, 64\) from the config, got \(48, 64\)")
case("tensor missing (load_model)", missing_tensor, r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight",
     r"expected shape \(128, 64\)")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_refused_then_engine_serves(case, llm, reference, tmp_path, request):
    with pytest.raises(Exception) as info:
        case.call(Env(llm, tmp_path, request))
    msg = str(info.value)
    assert info.type is case.exc, f"{info.type.__name__}: {msg}"
    assert re.search(case.field, msg), f"the message does not name the field: {msg}"
    assert re.search(case.limit, msg), f"the message does not state the limit: {msg}"
    serves_good_requests(llm, reference)


def test_table_covers_every_entry_point():
    assert len(CASES) >= 30 and len({c.name for c in CASES}) == len(CASES)
    # (abort_request of an unknown or finished id is not bad input: vLLM ignores it, as pagedjax
    # does; tests/test_engine.py pins that)
    for what in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "preemption_mode",
                 "scheduling", "allocation", "attention_backend", "tensor_parallel_size", "Pallas kernel",
                 "max_model_len", "empty", "vocab", "sampling params", "SamplingParams.n=", "temperature",
                 "top_p", "top_k", "min_p", "max_tokens", "seed", "logprobs", "stop", "duplicate", "'#'",
                 "n > max_num_seqs", "paged_attention:", "ragged_paged_attention:",
                 "head_dim", "num_kv_heads", "block tables", "missing model path", "architecture", "shape"):
        assert any(what in c.name for c in CASES), what
