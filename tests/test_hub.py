"""Models from the Hugging Face hub, dtype="auto" and vLLM's engine arguments.

A hub id ("owner/name") is served from a Hugging Face cache laid out as huggingface_hub lays it
(`models--owner--name/refs/<ref>` holding a commit, `snapshots/<commit>/` the files), built here
from tiny random Llamas: every test runs offline (HF_HUB_OFFLINE=1), except the one that points
the hub at a closed port to time a failing download.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil

import jax
import jax.numpy as jnp
import pytest

from engine_helpers import SMALL, ids, make_tiny_hf
from pagedjax import LLM, SamplingParams
from pagedjax.engine import LLMEngine
from pagedjax.engine_args import NO_EFFECT
from pagedjax.model.hub import (BUILTIN_MODELS, checkpoint_dtype, float_dtype, hf_cache_dir, load_any_model,
                                resolve_dtype, resolve_model)

# one step bucket, as tests/test_bad_input.py: every engine of the tiny HF model shares one compilation
KW = dict(SMALL, token_buckets=(32,), page_buckets=(16,))
REPO = "acme/tiny-llama"
MAIN, V2 = (hashlib.sha1(ref.encode()).hexdigest() for ref in ("main", "v2"))
PROMPT = ids([5, 17, 42, 99, 7, 3, 250])
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def write_tokenizer(path, prefix: str = "w") -> None:
    """A word-level tokenizer of the tiny model's 320 ids ("<prefix>5" is id 5), saved as
    transformers saves one (tokenizer.json, tokenizer_config.json)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"{prefix}{i}": i for i in range(3, 320)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(path)


def add_snapshot(cache, repo_id: str, ref: str, commit: str, write):
    """`write` the files of `commit` into the cache's snapshot folder and point `ref` at it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    write(snap)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snap


def tiny_checkpoint(seed: int, prefix: str = "w"):
    def write(path):
        make_tiny_hf(seed).save_pretrained(path)   # config.json ("dtype": "float32") + model.safetensors
        write_tokenizer(path, prefix)
    return write


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """$HF_HOME with a hub cache: acme/tiny-llama at main (seed 0) and at the tag v2 (seed 1), and a
    tokenizer-only repo acme/tokenizer."""
    home = tmp_path_factory.mktemp("hf_home")
    cache = home / "hub"
    add_snapshot(cache, REPO, "main", MAIN, tiny_checkpoint(0))
    add_snapshot(cache, REPO, "v2", V2, tiny_checkpoint(1))
    add_snapshot(cache, "acme/tokenizer", "main", MAIN, lambda p: write_tokenizer(p, "t"))
    return home


@pytest.fixture
def cache(hf_home, monkeypatch):
    """The hub cache, found through $HF_HUB_CACHE, offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_home / "hub"))
    return hf_home / "hub"


def snapshot(cache, commit):
    return cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit


def greedy(llm) -> list[int]:
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def main_tokens(hf_home):
    """Greedy tokens of the main snapshot, loaded by its path."""
    return greedy(LLM(str(snapshot(hf_home / "hub", MAIN)), **KW))


# -- hub ids -------------------------------------------------------------------------------------
def test_hub_id_loads_its_cached_snapshot_like_the_directory(cache, main_tokens):
    llm = LLM(REPO, **KW)
    assert greedy(llm) == main_tokens
    assert llm.get_tokenizer().encode("w5 w17", add_special_tokens=False) == [5, 17]


def test_revision_picks_its_snapshot(cache, main_tokens):
    v2_tokens = greedy(LLM(REPO, revision="v2", **KW))
    assert v2_tokens == greedy(LLM(str(snapshot(cache, V2)), **KW))
    assert v2_tokens != main_tokens
    assert resolve_model(REPO, revision=V2) == str(snapshot(cache, V2))    # a commit hash, as a revision
    assert resolve_model(REPO, revision="main") == str(snapshot(cache, MAIN))


def test_cache_from_download_dir_and_hf_home(hf_home, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    assert hf_cache_dir() == hf_home / "hub"
    assert resolve_model(REPO) == str(snapshot(hf_home / "hub", MAIN))
    monkeypatch.setenv("HF_HOME", str(tmp_path))     # an empty cache: download_dir is where the model is
    with pytest.raises(FileNotFoundError):
        resolve_model(REPO)
    eng = LLMEngine(REPO, download_dir=str(hf_home / "hub"), **KW)
    assert eng.model_config.vocab_size == 320 and eng.dtype == jnp.float32


def test_missing_hub_id_offline_says_where_it_looked_and_what_else_to_pass(cache):
    with pytest.raises(FileNotFoundError) as info:
        LLM("acme/no-such-model", **KW)
    msg = str(info.value)
    assert "'acme/no-such-model'" in msg and f"local Hugging Face cache ({cache})" in msg, msg
    assert "could not be downloaded (HF_HUB_OFFLINE is set" in msg, msg
    assert all(name in msg for name in BUILTIN_MODELS), msg
    assert "config.json, *.safetensors and the tokenizer files, or a .gguf file" in msg, msg


def test_a_name_that_is_neither_path_nor_hub_id_lists_the_builtins(cache, tmp_path):
    for name in ("smollm-135m", str(tmp_path / "a" / "b")):
        with pytest.raises(FileNotFoundError, match=r"not a built-in model nor a Hugging Face hub id \(owner/name\)\. "
                                                    r"Built-in models: smollm2-135m \(.*\); tiny-random \(") as info:
            LLM(name, **KW)
        assert str(info.value).endswith(f"model path does not exist: {name}")


def test_unreachable_hub_says_so_and_falls_back_to_the_cache(cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")   # nothing listens on the discard port
    with pytest.raises(FileNotFoundError, match=r"could not be downloaded \(ConnectError: ") as info:
        resolve_model("acme/no-such-model")
    assert "Built-in models: smollm2-135m" in str(info.value)
    assert resolve_model(REPO) == str(snapshot(cache, MAIN))   # as huggingface_hub does offline: the cache


def test_tokenizer_from_another_directory_or_hub_id(cache):
    tok = LLMEngine(REPO, tokenizer="acme/tokenizer", **KW).tokenizer
    assert tok.encode("t5 t9", add_special_tokens=False) == [5, 9]
    local = cache / "models--acme--tokenizer" / "snapshots" / MAIN
    assert LLMEngine(REPO, tokenizer=str(local), **KW).tokenizer.encode("t7", add_special_tokens=False) == [7]


# -- dtype="auto" ----------------------------------------------------------------------------------
def with_config(src, dst, **fields):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(fields)
    (dst / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return dst


def test_auto_is_the_checkpoints_dtype_and_float32_on_a_cpu(cache, tmp_path, caplog):
    f32 = snapshot(cache, MAIN)
    assert checkpoint_dtype(str(f32)) == "float32" and LLMEngine(str(f32), **KW).dtype == jnp.float32
    bf16 = with_config(f32, tmp_path / "bf16", dtype="bfloat16")
    assert checkpoint_dtype(str(bf16)) == "bfloat16"
    assert jax.default_backend() == "cpu"
    with caplog.at_level(logging.INFO, logger="pagedjax.model.hub"):
        eng = LLMEngine(str(bf16), **KW)
    assert eng.dtype == jnp.float32 and eng.runner.params["embed_tokens"].dtype == jnp.float32
    assert any("stored in bfloat16; float32 on a CPU" in r.getMessage() for r in caplog.records), caplog.text
    assert any("dtype float32" in r.getMessage() for r in caplog.records), caplog.text
    eng = LLMEngine(str(bf16), dtype="bfloat16", **KW)
    assert eng.dtype == jnp.bfloat16 and eng.runner.params["embed_tokens"].dtype == jnp.bfloat16
    # transformers before 5 wrote torch_dtype
    assert checkpoint_dtype(str(with_config(f32, tmp_path / "old", dtype=None, torch_dtype="float16"))) == "float16"


def test_auto_without_a_config_dtype_reads_the_tensors(tmp_path):
    import torch

    for torch_dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
        d = tmp_path / name
        make_tiny_hf().to(torch_dtype).save_pretrained(d)
        config = json.loads((d / "config.json").read_text())
        config.pop("dtype", None), config.pop("torch_dtype", None)
        (d / "config.json").write_text(json.dumps(config))
        assert checkpoint_dtype(str(d)) == name


def test_auto_for_gguf_builtins_and_loaded_models(tmp_path, monkeypatch):
    import gguf
    import numpy as np

    def write(path, types):
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tensor("output_norm.weight", np.ones(64, np.float32))
        for name, t in types.items():
            x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
            if t == gguf.GGMLQuantizationType.Q8_0:
                w.add_tensor(name, gguf.quants.quantize(x, t), raw_dtype=t)
            else:
                w.add_tensor(name, x.astype(np.float16))
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        return str(path)

    Q8 = gguf.GGMLQuantizationType.Q8_0
    f16 = write(tmp_path / "f16.gguf", {"token_embd.weight": "f16", "blk.0.attn_q.weight": "f16"})
    q8 = write(tmp_path / "q8.gguf", {"token_embd.weight": "f16", "blk.0.attn_q.weight": Q8})
    assert checkpoint_dtype(f16) == "float16" and checkpoint_dtype(q8) == "float32"   # quantized: dequantized
    assert checkpoint_dtype("tiny-random") == "float32"
    loaded = load_any_model("tiny-random", "bfloat16", 0)
    assert LLMEngine(loaded, **KW).dtype == jnp.float32                 # auto on a CPU
    assert LLMEngine(loaded, dtype="float16", **KW).dtype == jnp.float16
    # elsewhere "auto" keeps a half-precision checkpoint's dtype
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_dtype("auto", "bfloat16", "m") == jnp.bfloat16 and resolve_dtype("auto", None, "m") == jnp.float32


def test_explicit_dtypes_and_vllm_aliases():
    import numpy as np

    assert [float_dtype(d).name for d in ("half", "float", "bfloat16", np.float16, jnp.bfloat16)] == \
        ["float16", "float32", "bfloat16", "float16", "bfloat16"]
    with pytest.raises(ValueError, match=r"^dtype must be 'auto' or one of float32, bfloat16, float16, got 'int8'"):
        LLM("tiny-random", dtype="int8", **KW)


# -- vLLM's engine arguments ---------------------------------------------------------------------
def test_arguments_without_effect_warn_once_and_change_nothing(cache, main_tokens, caplog):
    # (enforce_eager is not among them: LLM takes it as "compile each bucket on first use", tests/test_compile.py)
    noop = dict(trust_remote_code=True, disable_log_stats=True, tokenizer_mode="auto",
                swap_space=4, max_seq_len_to_capture=8192, disable_custom_all_reduce=True, compilation_config=3,
                hf_overrides={}, distributed_executor_backend="mp", worker_cls="auto")
    fine = dict(quantization=None, kv_cache_dtype="auto", load_format="auto", pipeline_parallel_size=1,
                enable_lora=False, tokenizer_revision=None, seed=0)
    assert set(noop) <= set(NO_EFFECT)
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(snapshot(cache, MAIN)), **KW, **noop, **fine)
    ours = [r for r in caplog.records if r.name.startswith("pagedjax") and r.levelno >= logging.WARNING]
    assert len(ours) == 1, caplog.text
    msg = ours[0].getMessage()
    assert all(name in msg for name in noop) and not any(f"{name} (" in msg for name in fine), msg
    assert greedy(llm) == main_tokens
    caplog.clear()
    eng = LLMEngine("tiny-random", num_gpu_blocks_override=40, **KW)   # vLLM's name for num_blocks
    assert eng.config.num_blocks == 40 and not caplog.records


def test_unknown_argument_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"LLMEngine got unexpected keyword arguments \['foo', 'max_num_seq'\]") as info:
        LLM("tiny-random", foo=1, max_num_seq=4)
    assert str(info.value).endswith("did you mean 'max_num_seqs' for 'max_num_seq'")


@pytest.mark.parametrize("name,value", [("quantization", "awq"), ("kv_cache_dtype", "fp8"),
                                        ("pipeline_parallel_size", 2), ("enable_lora", True)])
def test_arguments_that_cannot_be_ignored_are_refused(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be .*got {value!r}$"):
        LLM("tiny-random", **{name: value}, **KW)
