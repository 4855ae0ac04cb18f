"""Experiments on the engine, apart from it: they talk to it only through its public API
(LLMEngine / LLM) and the statistics it records itself (scheduler metrics per step, StepTiming per
engine step). Nothing here swaps an engine's parts or methods.

    serving.py       workloads, engine systems (continuous, static, contiguous) and Hugging Face
                     baselines, vLLM's serving metrics, the capacity study, the block-size ablation
    plots.py         PNGs of timelines, KV use, latency CDFs and ablations (needs matplotlib: the
                     [bench] extra, which `make run` installs)
    soak.py          thousands of requests through the scheduler or the engine: nothing lost
    memory_study.py  the fragmentation experiment through the real allocators
    timeline.py      the static-vs-continuous sandbox on the real scheduler
"""
