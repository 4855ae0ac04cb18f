"""Fixtures: the tiny random model the tests, the CPU smoke runs and the examples use.

    LLM("tiny-random") is a 2-layer Llama (hidden 64, 4 heads over 2 kv heads of 16, vocab 384)
    with random weights (the engine's seed) and a byte-level tokenizer: any string round-trips.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedjax.model.llama import ModelConfig

TINY_RANDOM = ModelConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                          tie_word_embeddings=True, max_position_embeddings=4096, bos_token_id=1,
                          eos_token_ids=(2,), architecture="LlamaForCausalLM")


class ByteTokenizer:
    """The tiny random model's tokenizer: UTF-8 bytes shifted past the special ids (0 pad, 1 bos,
    2 eos), so any string round-trips."""

    offset = 3
    eos_token_id = 2
    bos_token_id = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - self.offset for i in ids if self.offset <= i < 256 + self.offset).decode("utf-8", "replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **_):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return self.encode(text) if tokenize else text
