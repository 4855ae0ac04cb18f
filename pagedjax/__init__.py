"""pagedjax: PagedAttention and continuous batching in JAX and Pallas."""

from pagedjax.inputs import PromptType, TextPrompt, TokensPrompt
from pagedjax.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "TextPrompt", "TokensPrompt", "PromptType", "BeamSearchParams", "EngineConfig"]

# the engine imports JAX; the host-side modules (scheduler, block pool) must stay importable without it
_LAZY = {"LLM": "pagedjax.llm", "LLMEngine": "pagedjax.engine", "RequestOutput": "pagedjax.outputs",
         "CompletionOutput": "pagedjax.outputs", "BeamSearchParams": "pagedjax.beam_search",
         "EngineConfig": "pagedjax.config"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedjax' has no attribute {name!r}")
