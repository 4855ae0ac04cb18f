"""SamplingParams with vLLM's names and meanings. Pure Python: the host side imports it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to generate one request's tokens.

    n:               independent samples of the prompt (they share its KV blocks copy-on-write)
    temperature:     0 is greedy; otherwise logits are divided by it
    top_k:           keep the k most likely tokens (-1: all)
    top_p:           keep the smallest set of tokens whose probability reaches top_p
    min_p:           drop tokens below min_p x the most likely token's probability
    seed:            makes the request's samples reproducible alone or in any batch
    stop:            strings that end generation (not included in the text)
    stop_token_ids:  token ids that end generation (included in token_ids)
    max_tokens:      most tokens to generate
    ignore_eos:      keep generating past the end-of-sequence token
    logprobs:        return the log-probability of each sampled token and of the top `logprobs`
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    logprobs: int | None = None
    _stop: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        def bad(name, limit):
            raise ValueError(f"SamplingParams.{name} must be {limit}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "an int >= 1")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "an int >= 1")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            bad("temperature", ">= 0 (0 is greedy)")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            bad("top_k", "-1 (disabled) or an int >= 1")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            bad("seed", "None or an int in [0, 2**63)")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad("logprobs", "None or an int >= 0")
        if self.stop_token_ids is not None and not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "a list of non-negative ints")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            bad("stop", "a non-empty string or a list of them")
        self._stop = stop

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def stop_strings(self) -> list[str]:
        return self._stop
