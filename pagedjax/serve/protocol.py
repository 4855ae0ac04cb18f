"""The OpenAI API's request bodies, read into SamplingParams, and its response bodies.

Requests are plain JSON objects; each field is checked here (type and range) or by SamplingParams,
and a bad one is an `APIError` naming it (`param`) with status 400, so the client learns which
field and which limit. Fields the OpenAI API defines but the engine cannot honour (`suffix`,
`best_of` other than `n`, tools) are refused the same way rather than ignored; fields nobody
defines are ignored with a log line, as vLLM does.

The sampling fields: OpenAI's (`max_tokens`, `temperature`, `top_p`, `n`, `stop`, `seed`,
`presence_penalty`, `frequency_penalty`, `logit_bias`, `logprobs`) and vLLM's extra ones
(`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`, `spaces_between_special_tokens`,
`allowed_token_ids`, `bad_words`, `truncate_prompt_tokens`, `prompt_logprobs`).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from pagedjax.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error the client gets as {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "APIError"),
                          "param": self.param, "code": self.status}}


# vLLM's extra sampling fields, passed to SamplingParams under the same name
_EXTRA = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
          "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
          "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "prompt_logprobs")
_COMMON = ("model", "n", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
           "logit_bias", "stream", "stream_options", "user", "max_tokens") + _EXTRA
_COMMON += ("return_tokens_as_token_ids",)   # vLLM's: logprob tokens as "token_id:N"
COMPLETION_FIELDS = frozenset(_COMMON + ("prompt", "logprobs", "echo", "suffix", "best_of", "add_special_tokens"))
CHAT_FIELDS = frozenset(_COMMON + ("messages", "logprobs", "top_logprobs", "max_completion_tokens", "chat_template",
                                   "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                                   "tools", "tool_choice", "response_format", "parallel_tool_calls"))
_FIELD_IN_MESSAGE = re.compile(r"^(\w+)")


def _expect(body: dict, name: str, kinds: tuple, what: str):
    v = body.get(name)
    if v is not None and (not isinstance(v, kinds) or isinstance(v, bool) and bool not in kinds):
        raise APIError(f"{name} must be {what}, got {type(v).__name__}: {v!r}", name)
    return v


def _unknown(body: dict, known: frozenset, where: str) -> None:
    extra = sorted(set(body) - known)
    if extra:
        logger.warning("%s: ignoring unknown fields %s", where, extra)


def sampling_params(body: dict, *, max_tokens_field: str = "max_tokens", default_max_tokens: int | None = None,
                    num_logprobs: int | None = None, stream: bool = False) -> SamplingParams:
    """The request's SamplingParams (APIError naming the field if one is bad). `max_tokens` left out
    is `default_max_tokens`; null is no limit but max_model_len."""
    kw: dict[str, Any] = {}
    numbers = (int, float)
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty"):
        if _expect(body, name, numbers, "a number") is not None:
            kw[name] = float(body[name])
    for name in ("n", "top_k", "min_tokens", "seed", "truncate_prompt_tokens", "prompt_logprobs"):
        if _expect(body, name, (int,), "an integer") is not None:
            kw[name] = body[name]
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"):
        if _expect(body, name, (bool,), "a boolean") is not None:
            kw[name] = body[name]
    max_tokens = body.get(max_tokens_field, body.get("max_tokens", default_max_tokens))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)):
        raise APIError(f"{max_tokens_field} must be an integer, got {max_tokens!r}", max_tokens_field)
    kw["max_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise APIError(f"stop must be a string or a list of strings, got {stop!r}", "stop")
        kw["stop"] = stop
    for name in ("stop_token_ids", "allowed_token_ids", "bad_words"):
        v = _expect(body, name, (list,), "a list")
        if v is not None:
            kw[name] = v
    bias = _expect(body, "logit_bias", (dict,), "an object of token id -> bias")
    if bias is not None:
        kw["logit_bias"] = bias
    if num_logprobs is not None:
        kw["logprobs"] = num_logprobs
    if stream and kw.get("prompt_logprobs") is not None:
        raise APIError("prompt_logprobs is not compatible with streaming", "prompt_logprobs")
    kw["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        param = param_of(str(e), kw)
        raise APIError(str(e), max_tokens_field if param == "max_tokens" else param) from None


def param_of(message: str, fields) -> str | None:
    """The request field an error message starts with (SamplingParams' messages name it first)."""
    m = _FIELD_IN_MESSAGE.match(message)
    if m and m.group(1) in fields:
        return m.group(1)
    words = set(re.findall(r"\w+", message))
    named = [f for f in fields if f in words and f not in ("model", "n", "prompt", "stop")]
    return max(named, key=len) if named else None


def completion_prompts(body: dict) -> list:
    """`prompt` as a list of engine prompts: a string, a list of strings, token ids, or a list of
    token-id lists."""
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError("prompt is required", "prompt")
    add_special = body.get("add_special_tokens", True)
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise APIError("prompt must be a string, a list of strings, a list of token ids or a list of lists of them",
                       "prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append({"prompt": p, "add_special_tokens": add_special})
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            out.append({"prompt_token_ids": p})
        else:
            raise APIError("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                           f"them; got an element {p!r}", "prompt")
    return out


def parse_completion(body: dict) -> tuple[list, SamplingParams, dict]:
    """(engine prompts, SamplingParams, options) of a /v1/completions body."""
    _unknown(body, COMPLETION_FIELDS, "/v1/completions")
    if body.get("suffix") is not None:
        raise APIError("suffix is not supported", "suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise APIError(f"best_of must equal n ({body.get('n', 1)}): choosing the best of more samples is not "
                       f"supported, got {best_of!r}", "best_of")
    logprobs = _expect(body, "logprobs", (int,), "an integer")
    if logprobs is not None and logprobs < 0:
        raise APIError(f"logprobs must be non-negative, got {logprobs}", "logprobs")
    stream = bool(_expect(body, "stream", (bool,), "a boolean"))
    # OpenAI's (and vLLM's) completions default to 16 tokens; chat's to whatever max_model_len leaves
    params = sampling_params(body, default_max_tokens=16, num_logprobs=logprobs, stream=stream)
    echo = bool(_expect(body, "echo", (bool,), "a boolean"))
    return completion_prompts(body), params, {"stream": stream, "echo": echo, "logprobs": logprobs,
                                              "include_usage": _include_usage(body, stream),
                                              "token_ids": bool(body.get("return_tokens_as_token_ids"))}


def parse_chat(body: dict) -> tuple[list, SamplingParams, dict]:
    """(messages, SamplingParams, options) of a /v1/chat/completions body."""
    _unknown(body, CHAT_FIELDS, "/v1/chat/completions")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise APIError("messages must be a non-empty list of {'role': ..., 'content': ...} objects", "messages")
    if body.get("tools"):
        raise APIError("tools are not supported", "tools")
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
        raise APIError("response_format other than {'type': 'text'} is not supported", "response_format")
    want = _expect(body, "logprobs", (bool,), "a boolean")
    top = _expect(body, "top_logprobs", (int,), "an integer")
    if top and not want:   # top_logprobs=0 asks for nothing, and is fine without logprobs (as in vLLM)
        raise APIError("top_logprobs needs logprobs set to true", "top_logprobs")
    if top is not None and top < 0:
        raise APIError(f"top_logprobs must be non-negative, got {top}", "top_logprobs")
    stream = bool(_expect(body, "stream", (bool,), "a boolean"))
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params = sampling_params(body, max_tokens_field=field, num_logprobs=(top or 0) if want else None, stream=stream)
    for name, kinds in (("chat_template", (str,)), ("chat_template_kwargs", (dict,)),
                        ("add_generation_prompt", (bool,)), ("continue_final_message", (bool,))):
        _expect(body, name, kinds, kinds[0].__name__)
    options = {"stream": stream, "logprobs": bool(want), "top_logprobs": top or 0,
               "token_ids": bool(body.get("return_tokens_as_token_ids")),
               "include_usage": _include_usage(body, stream),
               "chat": dict(chat_template=body.get("chat_template"), chat_template_kwargs=body.get("chat_template_kwargs"),
                            add_generation_prompt=body.get("add_generation_prompt", True),
                            continue_final_message=body.get("continue_final_message", False))}
    return messages, params, options


def _include_usage(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise APIError("stream_options can only be set when stream is true", "stream_options")
    if not isinstance(opts, dict):
        raise APIError("stream_options must be an object", "stream_options")
    return bool(opts.get("include_usage"))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
