"""What the logits processors need for one step, packed on the host (numpy, no JAX).

The processors are vLLM's: `allowed_token_ids`, `bad_words`, `min_tokens`, `logit_bias`, then the
repetition, frequency and presence penalties (pagedjax.logits_processors applies them on the
device, in that order). A step in which no row uses any of them packs nothing (`pack` returns
None) and runs exactly the program it would run without them.

    LogitsInputs                                      (S rows, V vocabulary, L = max_model_len)
      bias               float32[S, V]  added to the logits: logit_bias, and -inf for each token the
                                        row may not produce now (outside allowed_token_ids, the last
                                        token of a bad word whose other tokens end the output, EOS
                                        and stop_token_ids before min_tokens)
      token_ids          int32[S, L]    the row's prompt + output tokens in its first lens[s] entries
      prompt_lens, lens  int32[S]       lens[s] = 0: the row has no penalties
      repetition_penalty, frequency_penalty, presence_penalty  float32[S]  (1, 0, 0: off)

One shape per row bucket S: every bias and ban is dense, so requests with and without processors
joining and leaving never compile anything new. The buffers are allocated once per S and only the
rows written last step are cleared.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from pagedjax.scheduler.output import SchedulerOutput
from pagedjax.scheduler.sequence import Request


@dataclass
class LogitsInputs:
    bias: np.ndarray
    token_ids: np.ndarray
    prompt_lens: np.ndarray
    lens: np.ndarray
    repetition_penalty: np.ndarray
    frequency_penalty: np.ndarray
    presence_penalty: np.ndarray

    @classmethod
    def neutral(cls, S: int, V: int, L: int) -> LogitsInputs:
        """Inputs that change no logit: padding rows, and warm-up."""
        f32, i32 = np.float32, np.int32
        return cls(bias=np.zeros((S, V), f32), token_ids=np.zeros((S, L), i32), prompt_lens=np.zeros(S, i32),
                   lens=np.zeros(S, i32), repetition_penalty=np.ones(S, f32), frequency_penalty=np.zeros(S, f32),
                   presence_penalty=np.zeros(S, f32))


def uses_penalties(sp) -> bool:
    return sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0


class _RowState:
    """A request's processor state that does not change from step to step."""

    def __init__(self, req: Request, V: int, L: int):
        sp = req.sampling_params
        self.static = None  # the dense bias row of logit_bias and allowed_token_ids, if any
        if sp.allowed_token_ids is not None or sp.logit_bias:
            row = np.zeros(V, np.float32)
            if sp.allowed_token_ids is not None:
                row[:] = -np.inf
                row[np.asarray(sp.allowed_token_ids, np.int64)] = 0.0
            for t, b in (sp.logit_bias or {}).items():
                row[t] += b
            self.static = row
        self.stop_ids = sorted({t for t in (sp.stop_token_ids or ()) if t < V}
                               | ({req.eos_token_id} if req.eos_token_id is not None and not sp.ignore_eos else set()))
        self.bad_words = req.bad_words_token_ids or []
        self.penalties = uses_penalties(sp)
        # the row's tokens, kept up to date by appending what is new since the last step
        self.tokens = np.zeros(L, np.int32) if self.penalties else None
        self.filled = 0

    def tokens_now(self, req: Request) -> np.ndarray:
        n = req.num_tokens
        if n < self.filled:  # cannot shrink today; rebuilt rather than trusted if it ever does
            self.filled = 0
        self.tokens[self.filled:n] = req.all_token_ids[self.filled:n]
        self.filled = n
        return self.tokens[:n]


class LogitsPacker:
    def __init__(self, vocab_size: int, max_model_len: int):
        self.V, self.L = vocab_size, max_model_len
        self._buffers: dict[int, LogitsInputs] = {}
        self._dirty: dict[int, list[int]] = {}     # rows of each buffer whose bias is not all zero
        self._state: weakref.WeakKeyDictionary[Request, _RowState] = weakref.WeakKeyDictionary()

    def buffers(self, S: int) -> LogitsInputs:
        buf = self._buffers.get(S)
        if buf is None:
            buf = self._buffers[S] = LogitsInputs.neutral(S, self.V, self.L)
            self._dirty[S] = []
        return buf

    def pack(self, out: SchedulerOutput, S: int) -> LogitsInputs | None:
        """The step's LogitsInputs for its S rows, or None if no row uses a logits processor."""
        rows = out.scheduled
        if not any(r.sampling_params.uses_logits_processors for r in rows):
            return None
        buf = self.buffers(S)
        for s in self._dirty[S]:
            buf.bias[s] = 0.0
        dirty = self._dirty[S] = []
        buf.lens.fill(0)
        buf.repetition_penalty.fill(1.0)
        buf.frequency_penalty.fill(0.0)
        buf.presence_penalty.fill(0.0)
        for s, req in enumerate(rows):
            sp = req.sampling_params
            if not sp.uses_logits_processors:
                continue
            st = self._state.get(req)
            if st is None:
                st = self._state[req] = _RowState(req, self.V, self.L)
            bias = buf.bias[s]
            if st.static is not None:
                bias[:] = st.static
                dirty.append(s)
            outputs = req.output_token_ids
            if req.num_output_tokens < sp.min_tokens and st.stop_ids:
                bias[st.stop_ids] = -np.inf
                dirty.append(s)
            for word in st.bad_words:
                k = len(word) - 1
                if k <= len(outputs) and (k == 0 or outputs[-k:] == word[:-1]):
                    bias[word[-1]] = -np.inf
                    dirty.append(s)
            if st.penalties:
                toks = st.tokens_now(req)
                buf.token_ids[s, :len(toks)] = toks
                buf.lens[s] = len(toks)
                buf.prompt_lens[s] = req.num_prompt_tokens
                buf.repetition_penalty[s] = sp.repetition_penalty
                buf.frequency_penalty[s] = sp.frequency_penalty
                buf.presence_penalty[s] = sp.presence_penalty
        return buf
