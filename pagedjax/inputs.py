"""Prompt types, as vLLM names them (`from pagedjax.inputs import TokensPrompt, TextPrompt`).

Plain dicts, so `{"prompt_token_ids": [...]}` and `TokensPrompt(prompt_token_ids=[...])` are the
same thing to the engine. A string prompt is a TextPrompt without options.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict, Union


class TextPrompt(TypedDict):
    """A prompt the engine tokenizes."""

    prompt: str
    # False when the text already holds the model's special tokens (a rendered chat template)
    add_special_tokens: NotRequired[bool]
    cache_salt: NotRequired[str]  # accepted for vLLM compatibility; prefix caching here is not salted


class TokensPrompt(TypedDict):
    """A prompt given as token ids (the text, if given, is reported back in the output)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = Union[str, TextPrompt, TokensPrompt, list[int]]
