"""pagedjax: PagedAttention and continuous batching in JAX and Pallas."""

from pagedjax.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "BeamSearchParams",
           "EngineConfig"]


def __getattr__(name):
    # the engine imports JAX; the host-side modules (scheduler, block pool) must stay importable without it
    if name in ("LLM", "LLMEngine", "RequestOutput", "CompletionOutput", "BeamSearchParams"):
        from pagedjax import engine

        return getattr(engine, name)
    if name == "EngineConfig":
        from pagedjax.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'pagedjax' has no attribute {name!r}")
