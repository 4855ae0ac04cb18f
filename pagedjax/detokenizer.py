"""Text as the tokens arrive: one IncrementalDetokenizer per sample of a request.

A token does not always end on a character: byte-level and byte-fallback tokenizers split a
multi-byte character over several tokens, and SentencePiece-style tokenizers put a word's leading
space in the token that starts it, which only the tokens before it can place. So text is emitted
only once it is whole:

  - where the tokenizer has a Rust backend (Hugging Face fast tokenizers), `tokenizers`'
    DecodeStream, primed with the end of the prompt, yields each token's text as soon as it is
    valid UTF-8;
  - otherwise the text of a short window of tokens before the new ones is decoded with and
    without them, and the difference is emitted unless it ends in an incomplete character.

Stop strings are looked for in the text as it grows, also across token boundaries.
"""

from __future__ import annotations

# tokens of context before the new ones: enough for any tokenizer's leading-space rules
_CONTEXT = 6


class IncrementalDetokenizer:
    """The text of a sample's generated tokens, grown one step at a time."""

    def __init__(self, tokenizer, prompt_token_ids, *, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.num_tokens = 0                      # generated tokens consumed so far
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._stream = DecodeStream(list(prompt_token_ids[-_CONTEXT:]), skip_special_tokens=skip_special_tokens)
        else:
            self._ids = list(prompt_token_ids[-_CONTEXT:])
            self._prefix = 0                      # window start in _ids
            self._read = len(self._ids)           # tokens whose text has been emitted

    def add(self, token_ids) -> str:
        """Consume new generated tokens; returns the text they complete (possibly "")."""
        new = []
        for t in token_ids:
            self.num_tokens += 1
            if self._stream is not None:
                piece = self._stream.step(self._backend, int(t))
                if piece:
                    new.append(piece)
            else:
                self._ids.append(int(t))
                new.append(self._window())
        delta = "".join(new)
        self.text += delta
        return delta

    def _window(self) -> str:
        decode = self.tokenizer.decode
        before = decode(self._ids[self._prefix:self._read], skip_special_tokens=self.skip_special_tokens)
        after = decode(self._ids[self._prefix:], skip_special_tokens=self.skip_special_tokens)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before):]
        return ""


def find_stop(text: str, stops, new_chars: int, include: bool) -> tuple[str, int] | None:
    """The first stop string in `text` that the last `new_chars` characters complete, as (the
    string, where the text ends: at its start, or after it when `include`), or None."""
    if not stops:
        return None
    start = max(0, len(text) - new_chars - max(len(s) for s in stops) + 1)
    best = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[1]):
            best = (s, i)
    if best is None:
        return None
    s, i = best
    return s, i + len(s) if include else i
