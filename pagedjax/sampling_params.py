"""SamplingParams with vLLM's fields, defaults, meanings and validation messages. Pure Python: the
host side imports it.

    from pagedjax import SamplingParams            # or pagedjax.sampling_params, as in vLLM
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=None, repetition_penalty=1.1)

Every field of vLLM's offline SamplingParams that pagedjax acts on is here with vLLM's name and
default; see the field comments for what each does. A SamplingParams is a plain, mutable object:
an assignment after construction is checked like the constructor's argument and takes effect for
requests added afterwards (the engine takes a copy, `clone()`, of what a request was added with).
"""

from __future__ import annotations

import copy
import enum
import logging
import math
from dataclasses import dataclass, field, fields
from typing import Any

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-5   # below it a temperature is greedy
_MAX_TEMP = 1e-2       # above 0 and below it, a temperature is raised to it (as vLLM does)


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries, as in vLLM."""

    CUMULATIVE = 0   # every output carries all the tokens and text so far
    DELTA = 1        # every output carries only what is new since the previous one
    FINAL_ONLY = 2   # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to generate one request's tokens (vLLM's names, defaults and checks)."""

    n: int = 1                          # independent samples of the prompt (sharing its KV blocks copy-on-write)
    presence_penalty: float = 0.0       # [-2, 2]: subtracted from tokens that appear in the output so far
    frequency_penalty: float = 0.0      # [-2, 2]: subtracted once per appearance in the output so far
    repetition_penalty: float = 1.0     # > 0: tokens of the prompt or output have positive logits divided
                                        # by it and negative ones multiplied (1 = off)
    temperature: float = 1.0            # [0, 2]; 0 is greedy
    top_p: float = 1.0                  # (0, 1]: the smallest set of tokens whose probability reaches it
    top_k: int = 0                      # the k most likely tokens; 0 or -1: all
    min_p: float = 0.0                  # [0, 1]: drop tokens below min_p x the most likely one's probability
    seed: int | None = None             # makes the request's samples reproducible alone or in any batch
    stop: str | list[str] | None = None             # strings that end generation (left out of the text)
    stop_token_ids: list[int] | None = None         # token ids that end generation (kept in token_ids)
    bad_words: list[str] | None = None              # words never generated (their last token is banned
                                                    # where it would complete one)
    include_stop_str_in_output: bool = False        # keep a matched stop string in the text
    ignore_eos: bool = False                        # keep generating past the end-of-sequence token
    max_tokens: int | None = 16                     # most tokens to generate; None: up to max_model_len
    min_tokens: int = 0                             # EOS and stop_token_ids are banned before this many
    logprobs: int | None = None                     # top logprobs to return per token (the sampled one always)
    prompt_logprobs: int | None = None              # top logprobs to return per prompt token
    detokenize: bool = True                         # text at all (stop strings need it)
    skip_special_tokens: bool = True                # leave special tokens out of the text
    spaces_between_special_tokens: bool = True      # accepted; fast tokenizers decide this themselves
    logit_bias: dict[int, float] | None = None      # added to those tokens' logits (clamped to [-100, 100])
    allowed_token_ids: list[int] | None = None      # only these tokens can be sampled
    truncate_prompt_tokens: int | None = None       # keep only the last k prompt tokens (-1: max_model_len - 1)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None        # kept, not read: for callers' own use
    _ready: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if 0 < self.temperature < _MAX_TEMP:
            logger.warning("temperature %s is less than %s, which may cause numerical errors nan or inf in "
                           "tensors. We have maxed it out to %s.", self.temperature, _MAX_TEMP, _MAX_TEMP)
            self.temperature = _MAX_TEMP
        if self.seed == -1:
            self.seed = None
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:  # greedy: the truncations do nothing
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        object.__setattr__(self, "_ready", True)

    def __setattr__(self, name: str, value: Any) -> None:
        # an assignment after construction is checked as the constructor's argument would be
        if not getattr(self, "_ready", False) or name == "_ready":
            object.__setattr__(self, name, value)
            return
        if name == "logit_bias" and value is not None:
            value = _logit_bias(value)
        elif name == "stop_token_ids" and value is not None:
            value = list(dict.fromkeys(value))
        previous = getattr(self, name)
        object.__setattr__(self, name, value)
        try:
            self._verify_args()
        except ValueError:
            object.__setattr__(self, name, previous)
            raise

    def _verify_args(self) -> None:
        def fail(msg):
            raise ValueError(msg)

        if not isinstance(self.n, int) or isinstance(self.n, bool):
            fail(f"n must be an int, but is of type {type(self.n)}")
        if self.n < 1:
            fail(f"n must be at least 1, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _number(v) or not -2.0 <= v <= 2.0:
                fail(f"{name} must be in [-2, 2], got {v}.")
        if not _number(self.repetition_penalty) or not math.isfinite(self.repetition_penalty):
            fail(f"repetition_penalty must be a finite number, got {self.repetition_penalty}.")
        if self.repetition_penalty <= 0.0:
            fail(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not _number(self.temperature) or not math.isfinite(self.temperature):
            fail(f"temperature must be a finite number, got {self.temperature}.")
        if self.temperature < 0.0:
            fail(f"temperature must be non-negative, got {self.temperature}.")
        if self.temperature > 2.0:
            fail(f"temperature must be in [0, 2], got {self.temperature}.")
        if self.temperature < _SAMPLING_EPS and self.n > 1:
            fail(f"n must be 1 when using greedy sampling, got {self.n}.")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            fail(f"top_k must be an integer, got {type(self.top_k).__name__}")
        if self.top_k < -1:
            fail(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            fail(f"seed must be None, -1 or an int in [0, 2**63), got {self.seed!r}.")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or (v < 0 and v != -1)):
                fail(f"{name} must be non-negative or -1, got {v}.")
        stops = self.stop_strings
        if not all(isinstance(s, str) for s in stops):
            fail(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if any(not s for s in stops):
            fail("stop cannot contain an empty string.")
        if stops and not self.detokenize:
            fail("stop strings are only supported when detokenize is True. Set detokenize=True to use stop.")
        ids = self.stop_token_ids or []
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            fail(f"stop_token_ids must contain only integers, got {self.stop_token_ids}.")
        if any(t < 0 for t in ids):
            fail(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids}.")
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple))
                                           or any(not isinstance(w, str) or not w for w in self.bad_words)):
            fail(f"bad_words cannot contain an empty string. Got bad_words={self.bad_words}")
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            if not isinstance(allowed, (list, tuple)) or not allowed:
                fail("allowed_token_ids is not None and empty!")
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in allowed):
                fail(f"allowed_token_ids must be non-negative token ids, got {allowed}.")
        if self.truncate_prompt_tokens is not None and (
                not isinstance(self.truncate_prompt_tokens, int)
                or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)):
            fail(f"truncate_prompt_tokens must be >= 1 or -1, got {self.truncate_prompt_tokens}")
        if not isinstance(self.output_kind, RequestOutputKind):
            fail(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")

    # -- derived ----------------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list (read on every use, so an assignment to `stop` takes effect)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def output_text_buffer_length(self) -> int:
        """Characters a streamed text holds back while a stop string could still be completing."""
        stops = self.stop_strings
        return max(len(s) for s in stops) - 1 if stops and not self.include_stop_str_in_output else 0

    @property
    def uses_logits_processors(self) -> bool:
        """Whether the request changes logits before sampling (penalties, biases, token bans)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_tokens > 0 or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words))

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's `SamplingParams.clone`)."""
        return copy.deepcopy(self)

    def replace(self, **changes) -> SamplingParams:
        """A checked copy with some fields changed."""
        kw = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        kw.update(changes)
        return SamplingParams(**kw)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _logit_bias(bias) -> dict[int, float]:
    """Token id -> bias, keys as ints (strings of digits accepted, as JSON gives them), biases
    clamped to [-100, 100] (vLLM's and OpenAI's range)."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
    out, bad = {}, []
    for token, b in bias.items():
        try:
            out[int(token)] = min(100.0, max(-100.0, float(b)))
        except (ValueError, TypeError):
            bad.append(token)
    if bad:
        raise ValueError(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}")
    return out


@dataclass
class BeamSearchParams:
    """LLM.beam_search's parameters (vLLM's names; pagedjax.beam_search runs it)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0            # only 0: beams extend by their most likely tokens
    length_penalty: float = 1.0         # a beam's score: cumulative logprob / generated length ** it

    def __post_init__(self):
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"BeamSearchParams.beam_width must be an int >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.temperature != 0.0:
            raise ValueError(f"BeamSearchParams.temperature must be 0 (beam search here is deterministic), "
                             f"got {self.temperature!r}")
