"""pagedjax: PagedAttention and continuous batching in JAX and Pallas."""

from pagedjax.engine_args import EngineArgs
from pagedjax.inputs import PromptType, TextPrompt, TokensPrompt
from pagedjax.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "TextPrompt", "TokensPrompt", "PromptType", "BeamSearchParams", "EngineConfig"]

# the engine imports JAX; the host-side modules (scheduler, block pool) must stay importable without it
_LAZY = {"LLM": "pagedjax.llm", "LLMEngine": "pagedjax.engine", "RequestOutput": "pagedjax.outputs",
         "CompletionOutput": "pagedjax.outputs",
         "EngineConfig": "pagedjax.config"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedjax' has no attribute {name!r}")
