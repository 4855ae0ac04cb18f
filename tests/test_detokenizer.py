"""Streaming text: IncrementalDetokenizer's deltas and find_stop, on the kinds of tokenizer a model
comes with, then end to end through the engine.

The text of a sample's generated tokens is, as vLLM defines it, the text of prompt + generated
tokens less the text of the prompt (`generated_text` below): the first generated token's leading
space is kept (" Paris", though a SentencePiece-style tokenizer decodes that token alone as
"Paris"), and a character the prompt leaves incomplete (a prompt given as token ids can end inside
one) is the generated text's once the new tokens complete it. Its deltas, however the tokens are
grouped into steps, join to that text, and no delta holds half a character.

Tokenizers (all built here, offline, except the real model's):
  sentencepiece  Llama/Mistral style: Metaspace "▁" with the leading space stripped on decode,
                 BPE with byte fallback (<0xE8>...), trained here on a few hundred sentences
  bytelevel      GPT-2 style byte-level BPE, trained here likewise
  bytes          the tiny model's ByteTokenizer (one token per UTF-8 byte, no Rust backend)
  *-fallback     a fast tokenizer behind an object with only encode/decode: the detokenizer's
                 path for tokenizers without a Rust backend
  smollm2        the default model's tokenizer, read from its GGUF (slow: about 5 s to parse)
"""

from __future__ import annotations

import functools
import json
import random

import pytest

from pagedjax.detokenizer import IncrementalDetokenizer, find_stop
from pagedjax.testing import ByteTokenizer

FFFD = "\ufffd"

TEXTS = [
    "The capital of France is Paris.",
    "  two  spaces,\ttabs and\nnew lines ",
    "café résumé naïve — déjà vu",
    "日本語のテキスト 🙂 and 👩‍💻 at work",
    "e\u0301 combining: n\u0303 a\u0308\u0301 🇫🇷 👍🏽 done",
    "12345 + 678 = ? (yes!)",
]

_WORDS = ("the capital of France is Paris and of Japan is Tokyo ; a quick brown fox jumps over the lazy dog "
          "café résumé naïve 日本 streaming text arrives token by token , 12345 + 678 = ? hello world")


def _corpus(n: int = 300, seed: int = 0) -> list[str]:
    r, words = random.Random(seed), _WORDS.split()
    return [" ".join(r.choice(words) for _ in range(r.randint(3, 12))) for _ in range(n)]


@functools.cache
def _sentencepiece():
    """Llama/Mistral's tokenizer.json layout on a small trained BPE: the byte tokens <0x00>..<0xFF>
    are in the model's vocab (not added tokens), so characters it never saw fall back to them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                                           show_progress=False))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@functools.cache
def _bytelevel():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>")


@functools.cache
def _smollm2():
    from pagedjax.model.hub import default_model_path, load_tokenizer

    return load_tokenizer(str(default_model_path()))  # downloads the GGUF once into ~/.cache/pagedjax


class _DecodeOnly:
    """A tokenizer with no `backend_tokenizer`: the detokenizer decodes windows itself."""

    def __init__(self, tok):
        self._tok = tok
        self.bos_token_id, self.eos_token_id = tok.bos_token_id, tok.eos_token_id

    def encode(self, text, add_special_tokens=True):
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens=True):
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


_MAKERS = {
    "sentencepiece": _sentencepiece,
    "bytelevel": _bytelevel,
    "bytes": ByteTokenizer,
    "sentencepiece-fallback": lambda: _DecodeOnly(_sentencepiece()),
    "bytelevel-fallback": lambda: _DecodeOnly(_bytelevel()),
    "smollm2": _smollm2,
    "smollm2-fallback": lambda: _DecodeOnly(_smollm2()),
}


@pytest.fixture(params=["sentencepiece", "bytelevel", "bytes", "sentencepiece-fallback", "bytelevel-fallback",
                        pytest.param("smollm2", marks=pytest.mark.slow),
                        pytest.param("smollm2-fallback", marks=pytest.mark.slow)])
def tok(request):
    t = _MAKERS[request.param]()
    assert (getattr(t, "backend_tokenizer", None) is None) == (request.param == "bytes"
                                                                or request.param.endswith("-fallback"))
    return t


def encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def generated_text(tok, prompt: list[int], gen: list[int], skip: bool = True) -> str:
    """vLLM's text of `gen` after `prompt`: the text of both less the prompt's, the prompt's taken
    up to its last whole character (its longest token prefix whose text is a prefix of the whole
    and does not end in U+FFFD); an incomplete character at the end is not text yet."""
    full = tok.decode(prompt + gen, skip_special_tokens=skip)
    for k in range(len(prompt), -1, -1):
        head = tok.decode(prompt[:k], skip_special_tokens=skip)
        if not head.endswith(FFFD) and full.startswith(head):
            return full[len(head):].rstrip(FFFD)
    raise AssertionError("unreachable: the empty prompt is a prefix")


def stream(tok, prompt, gen, chunks=None, skip: bool = True) -> list[str]:
    """The deltas of `gen` added in `chunks` (sizes; one token at a time by default)."""
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    chunks = chunks or [1] * len(gen)
    out, i = [], 0
    for c in chunks:
        out.append(d.add(gen[i:i + c]))
        i += c
    assert i >= len(gen) and d.num_tokens == len(gen)
    assert d.text == "".join(out)
    return out


def random_chunks(r: random.Random, n: int) -> list[int]:
    chunks = []
    while sum(chunks) < n:
        chunks.append(r.randint(1, 5))
    return chunks


def test_deltas_join_to_the_generated_text(tok):
    """Random prompts/generations cut anywhere (mid-word, mid-character, before a "▁" token), added
    one token at a time and in random chunks: the deltas join to `generated_text`, and none holds
    U+FFFD where that text has none."""
    r = random.Random(0)
    for trial in range(120):
        ids = encode(tok, r.choice(TEXTS) + r.choice(TEXTS))
        cut = r.randrange(len(ids) + 1)
        prompt, gen = ids[:cut], ids[cut:]
        expected = generated_text(tok, prompt, gen)
        assert FFFD not in expected
        for chunks in (None, random_chunks(r, len(gen))):
            deltas = stream(tok, prompt, gen, chunks)
            assert "".join(deltas) == expected, (trial, cut, chunks)
            assert not any(FFFD in d for d in deltas)


def test_the_first_token_keeps_its_leading_space():
    """A SentencePiece-style token "▁Paris" decodes alone to "Paris"; after the prompt its text is
    " Paris", as vLLM streams it, on both paths."""
    sp = _sentencepiece()
    prompt, gen = encode(sp, "The capital of France is"), encode(sp, "The capital of France is Paris")
    assert gen[:len(prompt)] == prompt
    gen = gen[len(prompt):]
    assert sp.convert_ids_to_tokens(gen) == ["▁Paris"] and sp.decode(gen) == "Paris"
    whole, head = sp.decode(prompt + gen), sp.decode(prompt)
    assert whole[len(head):] == generated_text(sp, prompt, gen) == " Paris"
    for t in (sp, _DecodeOnly(sp)):
        assert stream(t, prompt, gen) == [" Paris"]
        # a prompt that ends mid-word: the rest of the word, no space
        ids = encode(sp, "The capital of France is Paris")
        assert sp.convert_ids_to_tokens(ids[:3]) == ["▁", "T", "he"]
        assert "".join(stream(t, ids[:2], ids[2:])) == "he capital of France is Paris"
        # and a prompt of nothing: the text of the tokens alone
        assert "".join(stream(t, [], ids)) == "The capital of France is Paris"


def _mid_character_cuts(tok, ids):
    return [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(FFFD)]


def test_multibyte_characters_arrive_whole(tok):
    """Accents, CJK, emoji, ZWJ sequences, flags and combining marks, split over tokens: no delta
    holds a U+FFFD, each delta is whole characters, and the deltas join exactly. A prompt that
    ends inside a character: that character opens the generated text, nothing of the prompt's
    leaks into it."""
    text = "é 日本語 🙂 👩‍💻 🇫🇷 e\u0301"
    ids = encode(tok, text)
    assert tok.decode(ids) == text
    deltas = stream(tok, [], ids)
    assert "".join(deltas) == text and not any(FFFD in d for d in deltas)
    assert all(d.encode("utf-8").decode("utf-8") == d for d in deltas)
    assert sum(1 for d in deltas if not d) > 0  # some tokens completed no character
    cuts = _mid_character_cuts(tok, ids)
    assert cuts, "the text splits no character over tokens: it tests nothing"
    for k in cuts:
        expected = generated_text(tok, ids[:k], ids[k:])
        got = "".join(stream(tok, ids[:k], ids[k:]))
        assert got == expected and text.endswith(got) and FFFD not in got, (k, got, expected)


def test_a_long_run_of_byte_tokens_before_the_generated_ones():
    """The prompt's last tokens start inside a character (a run of byte-fallback tokens): the stream
    starts further back, where the character starts, so the prompt's bytes do not come out as
    U+FFFDs ahead of the generated text."""
    for t in (_sentencepiece(), _DecodeOnly(_sentencepiece())):
        ids, prompt = encode(t, "say 🙂🙂 🙂 ok"), encode(t, "say 🙂🙂")
        assert ids[:len(prompt)] == prompt
        assert _sentencepiece().convert_ids_to_tokens(prompt)[-8:] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"] * 2
        gen = ids[len(prompt):]
        assert "".join(stream(t, prompt, gen)) == generated_text(t, prompt, gen) == " 🙂 ok"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    """bos and eos mid-stream and eos at the end: skip_special_tokens=True drops them from the text,
    False keeps them, as decode(..., skip_special_tokens=...) does (the byte tokenizer drops them
    either way)."""
    r = random.Random(1)
    specials = [tok.bos_token_id, tok.eos_token_id]
    for trial in range(20):
        ids = encode(tok, r.choice(TEXTS) + r.choice(TEXTS))
        # between whole characters (a kept special token inside one: see the next test)
        bounds = [k for k in range(len(ids) + 1) if not tok.decode(ids[:k]).endswith(FFFD)]
        for _ in range(3):
            k = r.choice(bounds)
            ids.insert(k, r.choice(specials))
            bounds = [b + (b >= k) for b in bounds] + [k]
        ids.append(tok.eos_token_id)
        cut = r.choice(bounds)
        prompt, gen = ids[:cut], ids[cut:]
        expected = generated_text(tok, prompt, gen, skip)
        for chunks in (None, random_chunks(r, len(gen))):
            assert "".join(stream(tok, prompt, gen, chunks, skip)) == expected, (trial, cut)
        eos = tok.decode([tok.eos_token_id], skip_special_tokens=False)
        if skip or isinstance(tok, ByteTokenizer):
            assert eos not in expected or not eos
        else:
            assert expected.endswith(eos)


def test_a_kept_special_token_inside_a_character():
    """skip_special_tokens=False and eos inside a byte-fallback character: the tokenizer decodes the
    whole run of byte tokens as U+FFFDs, even the characters already streamed, so no stream can
    match it; the detokenizer carries on (DecodeStream alone raises "Invalid prefix" here) and keeps
    what it sent."""
    sp = _sentencepiece()
    ids = encode(sp, "a 👩‍💻 b")
    tokens = sp.convert_ids_to_tokens(ids)
    k = len(tokens) - 1 - tokens[::-1].index("<0xF0>") + 2  # inside 💻
    gen = ids[:k] + [sp.eos_token_id] + ids[k:]
    for t in (sp, _DecodeOnly(sp)):
        for chunks in (None, [3] * len(gen)):
            text = "".join(stream(t, [], gen, chunks, skip=False))
            assert text.startswith("a 👩\u200d") and text.endswith("</s>" + FFFD * 2 + " b"), text
    assert "👩" not in sp.decode(gen, skip_special_tokens=False)


# ---- find_stop ----------------------------------------------------------------------------------


def test_find_stop_across_token_deltas(tok):
    """A stop string spanning several tokens' deltas is found when its last character arrives."""
    text = "The capital of France is Paris."
    stop = "France is"
    ids = encode(tok, text)
    d = IncrementalDetokenizer(tok, [])
    seen, hits, first = "", [], None
    for step, t in enumerate(ids):
        delta = d.add([t])
        seen += delta
        hit = find_stop(seen, [stop], len(delta), include=False)
        if hit is not None:
            hits.append((step, hit))
        if first is None and stop in seen:
            first = step
    assert seen == text and len(hits) == 1, hits  # found once: not again in later steps
    assert hits == [(first, (stop, text.index(stop)))]
    # it took more than one token's delta
    assert len(encode(tok, stop)) > 1


def test_find_stop_positions():
    text = "hello world, hello there"
    assert find_stop(text, ["world"], len(text), include=False) == ("world", 6)
    assert find_stop(text, ["world"], len(text), include=True) == ("world", 11)
    # the earliest among several, whatever their order in the list
    assert find_stop(text, ["there", "hello", "lo w"], len(text), include=False) == ("hello", 0)
    assert find_stop(text, ["there", "lo w"], len(text), include=True) == ("lo w", 7)
    assert find_stop(text, [], len(text), include=False) is None
    assert find_stop(text, None, len(text), include=False) is None
    assert find_stop(text, ["absent"], len(text), include=False) is None
    # no new characters: nothing new to find
    assert find_stop(text, ["there"], 0, include=False) is None


def test_find_stop_only_matches_the_new_characters_complete():
    """`new_chars`: the last characters of `text` are new; a stop string wholly in the text before
    them was searched for when that was new, and is not found again, also when a longer stop
    string reaches further back."""
    text = "ab" + "cdefgh"
    assert find_stop(text, ["ab"], 6, include=False) is None
    assert find_stop(text, ["ab", "7 chars"], 6, include=False) is None
    assert find_stop(text, ["7 chars", "ab"], 3, include=False) is None
    # one that the new characters end is found, however far back it starts
    assert find_stop(text, ["bcdef", "ab"], 3, include=False) == ("bcdef", 1)
    assert find_stop(text, ["fg", "ab"], 2, include=True) == ("fg", 7)
    assert find_stop(text, ["ef"], 2, include=True) is None


# ---- end to end ---------------------------------------------------------------------------------

# random byte sequences over these, often not UTF-8: é, 日 (E6 97 A5), a space and "a"
_BYTES = (0xC3, 0xA9, 0xE6, 0x97, 0xA5, 0x20, 0x61)


@pytest.fixture(scope="module")
def llm():
    from pagedjax import LLM

    return LLM("tiny-random", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)


def _run(llm, params: dict) -> dict:
    """Each request's outputs, step by step, run together in one engine loop."""
    eng = llm.llm_engine
    for rid, sp in params.items():
        eng.add_request(rid, "bytes: ", sp)
    outs = {rid: [] for rid in params}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id].append(o)
    return outs


def _params(**kw):
    from pagedjax import SamplingParams
    from pagedjax.sampling_params import RequestOutputKind

    kind = kw.pop("kind")
    return SamplingParams(temperature=1.0, seed=kw.pop("seed", 5), max_tokens=60, ignore_eos=True,
                          allowed_token_ids=[b + ByteTokenizer.offset for b in _BYTES],
                          output_kind=getattr(RequestOutputKind, kind), **kw)


def test_engine_delta_and_cumulative_text_of_random_bytes(llm):
    """The same seeded request as DELTA and as CUMULATIVE outputs: the deltas join to the final
    text, which is the tokens' text by `generated_text`, and the text at every step is a prefix of
    the final one (no half character sent as U+FFFD and then mended)."""
    outs = _run(llm, {"delta": _params(kind="DELTA"), "cumulative": _params(kind="CUMULATIVE")})
    delta, cum = outs["delta"], outs["cumulative"]
    ids = [t for o in delta for t in o.outputs[0].token_ids]
    final = cum[-1].outputs[0]
    assert cum[-1].finished and delta[-1].finished and ids == list(final.token_ids) and len(ids) == 60
    tok = llm.get_tokenizer()
    prompt = delta[0].prompt_token_ids
    assert final.text == generated_text(tok, prompt, ids)
    assert "".join(o.outputs[0].text for o in delta) == final.text
    so_far = ""
    for d, c in zip(delta, cum):
        so_far += d.outputs[0].text
        assert c.outputs[0].text == so_far and final.text.startswith(so_far)
    # the sequence was worth testing: whole multi-byte characters and invalid bytes both
    assert any(ord(ch) > 127 and ch != FFFD for ch in final.text) and FFFD in final.text
    # and the same seed gives the same text
    again = _run(llm, {"again": _params(kind="FINAL_ONLY")})["again"][-1].outputs[0]
    assert again.text == final.text and list(again.token_ids) == ids


@pytest.mark.parametrize("include", [False, True])
def test_engine_stop_string_of_a_multibyte_character(llm, include):
    """stop=["é", c] with c the first multi-byte character of the unstopped text: the text ends at
    the earlier of them (before it, or after it with include_stop_str_in_output), finish_reason
    "stop", the stop string as stop_reason, and the tokens up to the one completing it."""
    free = _run(llm, {"free": _params(kind="FINAL_ONLY")})["free"][-1].outputs[0]
    first = next(ch for ch in free.text if ord(ch) > 127 and ch != FFFD)
    stops = ["é", first] if first != "é" else ["é"]
    at = min(free.text.index(s) for s in stops if s in free.text)
    s = free.text[at]
    outs = _run(llm, {k: _params(kind=k, stop=stops, include_stop_str_in_output=include)
                      for k in ("DELTA", "CUMULATIVE", "FINAL_ONLY")})
    tok = llm.get_tokenizer()
    ids = list(free.token_ids)
    n = next(n for n in range(1, len(ids) + 1) if s in tok.decode(ids[:n]))
    for kind, got in outs.items():
        text = "".join(o.outputs[0].text for o in got) if kind == "DELTA" else got[-1].outputs[0].text
        out = got[-1].outputs[0]
        tokens = [t for o in got for t in o.outputs[0].token_ids] if kind == "DELTA" else list(out.token_ids)
        assert got[-1].finished and out.finish_reason == "stop" and out.stop_reason == s, kind
        assert text == free.text[:at + (len(s) if include else 0)], kind
        assert tokens == ids[:n], kind


def test_engine_prompt_ending_inside_a_character(llm):
    """A prompt of token ids that ends with the first byte of "é": the generated byte that
    completes it makes "é" the output's text."""
    from pagedjax import SamplingParams

    tok = llm.get_tokenizer()
    prompt = tok.encode("caf") + [0xC3 + ByteTokenizer.offset]
    eng = llm.llm_engine
    eng.add_request("cafe", {"prompt_token_ids": prompt},
                    SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=[0xA9 + ByteTokenizer.offset]))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    out = outs[-1].outputs[0]
    assert list(out.token_ids) == [0xA9 + ByteTokenizer.offset] and out.text == "é"
