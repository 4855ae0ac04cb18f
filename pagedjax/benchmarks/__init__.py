"""Experiments on the engine, apart from it: they talk to it only through its public API
(LLMEngine / LLM) and the statistics it records itself (scheduler metrics per step, StepTiming per
engine step). Nothing here swaps an engine's parts or methods.

    serving.py       workloads, engine systems (continuous, static, contiguous) and Hugging Face
                     baselines, vLLM's serving metrics, the capacity study, the block-size ablation
    plots.py         PNGs of timelines, KV use, latency CDFs and ablations (needs matplotlib: the
                     [bench] extra, which `make run` installs)
    soak.py          thousands of requests through the scheduler or the engine: nothing lost
    memory_study.py  the fragmentation experiment through the real allocators
    cost_model.py    StepCostModel: seconds per step from what it computed (fitted to measured
                     steps, or derived from an accelerator's published numbers)
    paper.py         the PagedAttention paper's evaluation: fitted ShareGPT / Alpaca workloads,
                     the serving simulator (real scheduler and allocator in virtual time) and its
                     validation against the real engine, Orca's reservation policies, sharing
    timeline.py      the static-vs-continuous sandbox on the real scheduler
"""
