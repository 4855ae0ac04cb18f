"""Loaders: HF directories (single file, sharded), GGUF files, and the errors for bad checkpoints."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from pagedjax.model import load_model
from test_model import make_hf_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    hf = make_hf_model("llama-untied-bias")
    hf.save_pretrained(path)
    return hf, path


def _copy_dir(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_missing_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model(missing)


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_directory_without_safetensors(hf_dir, tmp_path):
    d = _copy_dir(hf_dir[1], tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(d)


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="gguf"):
        load_model(f)


def test_unsupported_architecture(hf_dir, tmp_path):
    d = _copy_dir(hf_dir[1], tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"architectures=\['GPT2LMHeadModel'\].*LlamaForCausalLM.*Qwen2ForCausalLM"):
        load_model(d)


def test_wrong_shape_names_tensor_and_shapes(hf_dir, tmp_path):
    d = _copy_dir(hf_dir[1], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    assert tensors[name].shape == (32, 64)
    tensors[name] = np.zeros((48, 64), np.float32)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name}.*expected shape \(32, 64\).*got \(48, 64\)"):
        load_model(d)


def test_missing_tensor_is_named(hf_dir, tmp_path):
    d = _copy_dir(hf_dir[1], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.bias"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.0\.mlp\.up_proj\.bias"):
        load_model(d)


def test_sharded_checkpoint_and_tokenizer(hf_dir, tmp_path):
    """A sharded save (with model.safetensors.index.json) loads to the same params; a tokenizer in
    the directory is loaded with it; bf16 checkpoints load too."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    hf, single = hf_dir
    d = tmp_path / "sharded"
    hf.save_pretrained(d, max_shard_size="40KB")
    assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("*.safetensors"))) > 2
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, 300)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>").save_pretrained(d)

    cfg_a, params_a, tok_a = load_model(single)
    cfg_b, params_b, tok_b = load_model(d)
    assert tok_a is None and tok_b is not None
    assert tok_b("t5 t17")["input_ids"] == [5, 17]
    assert cfg_a == cfg_b
    jax.tree.map(np.testing.assert_array_equal, params_a, params_b)

    bf = tmp_path / "bf16"
    make_hf_model("llama-untied-bias").to(torch.bfloat16).save_pretrained(bf)  # same seed, same weights
    cfg_c, params_c, _ = load_model(bf, dtype="bfloat16")
    assert params_c["lm_head"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(params_c["lm_head"], np.float32), params_a["lm_head"], rtol=1e-2)


# ----------------------------------------------------------------------------------------------
# GGUF


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows of Llama models."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, hf, head_count_kv=None) -> dict[str, np.ndarray]:
    """Write `hf` (a LlamaForCausalLM) as llama.cpp would: GGUF names, permuted q/k, a byte-level
    BPE tokenizer with a chat template. ffn_up is stored as Q8_0 to exercise dequantization.
    Returns the HF tensors a loader should recover (ffn_up after its quantization round trip).
    `head_count_kv` overrides the metadata only, to make a file that disagrees with itself."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    c = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("pagedjax tiny test")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(head_count_kv or c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    b2u = bytes_to_unicode()
    tokens = ["<unk>", "<s>", "</s>"] + [b2u[i] for i in range(256)]
    merges = ["h e", "l l", "he ll", "o r", "w or"]
    tokens += ["he", "ll", "hell", "or", "wor"]
    tokens += [f"<extra_{i}>" for i in range(c.vocab_size - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")

    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    expected = dict(sd)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        up = sd[p + "mlp.up_proj.weight"]
        q8 = gguf.quants.quantize(up, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(f"blk.{i}.ffn_up.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        expected[p + "mlp.up_proj.weight"] = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_gguf_unpermutes_q_k_and_dequantizes(tmp_path):
    hf = make_hf_model("llama-untied")
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", hf)
    cfg, params, tok = load_model(tmp_path / "tiny.gguf")

    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert not cfg.tie_word_embeddings and cfg.rope_theta == 10000.0 and cfg.eos_token_ids == (2,)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for ours, theirs in [("q_proj", "self_attn.q_proj.weight"), ("k_proj", "self_attn.k_proj.weight"),
                             ("v_proj", "self_attn.v_proj.weight"), ("up_proj", "mlp.up_proj.weight"),
                             ("down_proj", "mlp.down_proj.weight")]:
            np.testing.assert_array_equal(params["layers"][ours][i], expected[p + theirs].T, err_msg=f"{i} {ours}")
    np.testing.assert_array_equal(params["lm_head"], expected["lm_head.weight"].T)
    # Q8_0 is lossy: the round trip must actually have changed something, or this tests nothing
    assert not np.array_equal(expected["model.layers.0.mlp.up_proj.weight"],
                              hf.state_dict()["model.layers.0.mlp.up_proj.weight"].numpy())
    assert tok is not None and tok.bos_token_id == 1
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False) == "<s>hello</s>"


def test_gguf_config_and_tokenizer_are_converted_once(tmp_path, monkeypatch):
    """The config and tokenizer transformers converts from a .gguf are saved under the cache and
    read from there the next time; a damaged copy or a changed file is converted again."""
    import os

    import transformers

    from pagedjax.model.weights import gguf_config_and_tokenizer

    monkeypatch.setenv("PAGEDJAX_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, make_hf_model("llama-untied"))
    cfg_a, params_a, tok_a = load_model(path)
    saved = list((tmp_path / "cache" / "gguf").iterdir())
    assert len(saved) == 1 and (saved[0] / "config.json").is_file()

    converted = []
    real = transformers.AutoConfig.from_pretrained

    def counting(*args, **kwargs):
        if kwargs.get("gguf_file"):
            converted.append(kwargs["gguf_file"])
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", counting)
    cfg_b, params_b, tok_b = load_model(path)
    assert converted == []    # read from the saved copy
    assert cfg_b == cfg_a
    jax.tree.map(np.testing.assert_array_equal, params_a, params_b)
    for text in ["hello world", "hell or wor", "<s>x</s>"]:
        assert tok_b(text)["input_ids"] == tok_a(text)["input_ids"]
    conv = [{"role": "user", "content": "hello"}]
    assert tok_b.apply_chat_template(conv, tokenize=False) == tok_a.apply_chat_template(conv, tokenize=False)
    assert (tok_b.bos_token_id, tok_b.eos_token_id) == (tok_a.bos_token_id, tok_a.eos_token_id)

    (saved[0] / "config.json").write_text("{not json")
    converted.clear()
    assert gguf_config_and_tokenizer(path)[0].num_hidden_layers == 2 and converted == ["tiny.gguf"]
    assert gguf_config_and_tokenizer(path)[0].num_hidden_layers == 2 and converted == ["tiny.gguf"]   # mended
    converted.clear()
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))    # the file changed
    gguf_config_and_tokenizer(path)
    assert converted == ["tiny.gguf"] and len(list((tmp_path / "cache" / "gguf").iterdir())) == 2
    # a file that is gone loses its saved conversion when another file's is saved
    other = tmp_path / "other.gguf"
    os.replace(path, other)
    gguf_config_and_tokenizer(other)
    assert [d.name.split("-")[0] for d in (tmp_path / "cache" / "gguf").iterdir()] == ["other"]


def test_gguf_shape_disagreeing_with_config(tmp_path):
    # metadata claims 4 kv heads (attn_k of 4 * 16 = 64 rows) while the tensors hold 2
    write_tiny_gguf(tmp_path / "bad.gguf", make_hf_model("llama-untied"), head_count_kv=4)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_k\.weight: expected shape \(64, 64\).*got \(32, 64\)"):
        load_model(tmp_path / "bad.gguf")
