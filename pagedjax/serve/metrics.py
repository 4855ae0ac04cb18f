"""The server's /metrics: Prometheus text format, vLLM's metric names where vLLM has the metric.

    vllm:num_requests_running, vllm:num_requests_waiting, vllm:num_requests_swapped   gauges
    vllm:kv_cache_usage_perc                            share of the KV pool's blocks in use (0..1)
    vllm:prefix_cache_queries, vllm:prefix_cache_hits   counters, in tokens
    vllm:num_preemptions                                counter
    vllm:prompt_tokens, vllm:generation_tokens          counters (prefill tokens as computed, generated
                                                        tokens as their request finishes)
    vllm:request_success{finished_reason}               counter
    vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
    vllm:request_time_per_output_token_seconds, vllm:e2e_request_latency_seconds,
    vllm:request_queue_time_seconds                     histograms
    pagedjax:kv_free_blocks, pagedjax:kv_num_blocks     the pool's free and usable blocks
    pagedjax:engine_steps, pagedjax:engine_step_seconds, pagedjax:engine_loop_seconds
        steps, the time inside LLMEngine.step(), and the engine loop's busy wall time (steps plus
        what the server does between them), so their difference is the server's overhead per step

Gauges are refreshed by the engine thread after every step (plain numbers, read by the scrape);
request histograms are observed when a request finishes. Counters carry prometheus_client's
`_total` suffix in the text, as vLLM's do.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from pagedjax.outputs import RequestOutput

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0, 160.0, 640.0)
_TOKEN = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        disable_created_metrics()   # no *_created samples (vLLM's /metrics has none either)
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.swapped = gauge("vllm:num_requests_swapped", "Requests swapped out to the host pool.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent usage.")
        self.free_blocks = gauge("pagedjax:kv_free_blocks", "Free blocks of the KV pool (cached blocks no request holds included).")
        self.num_blocks = gauge("pagedjax:kv_num_blocks", "Usable blocks of the KV pool.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens of finished requests.")
        self.success = Counter("vllm:request_success", "Finished requests.", labels + ["finished_reason"], registry=r)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens.", _TOKEN)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds", "Time per output token of a request.",
                              _TOKEN)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY)
        self.queue = histogram("vllm:request_queue_time_seconds", "Time a request waited before its first step.",
                               _LATENCY)
        self.steps = counter("pagedjax:engine_steps", "Engine steps run.")
        self.step_seconds = counter("pagedjax:engine_step_seconds", "Wall time inside LLMEngine.step().")
        self.loop_seconds = counter("pagedjax:engine_loop_seconds",
                                    "Busy wall time of the engine loop: steps and the server's work between them.")

    def refresh(self, engine) -> None:
        """The gauges from the engine's state (on the engine thread: after a step, or before idling)."""
        sched = engine.scheduler
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.swapped.set(len(sched.swapped))
        usage = sched.kv.usage()
        self.kv_usage.set(usage.usage)
        self.free_blocks.set(sched.kv.num_free_blocks())
        self.num_blocks.set(usage.num_blocks)

    def on_step(self, engine, outputs, seconds: float, loop_seconds: float) -> None:
        """After each step, on the engine thread."""
        self.refresh(engine)
        steps = engine.scheduler.metrics.steps
        if steps:
            last = steps[-1]
            self.prefix_queries.inc(last.prefix_query_tokens)
            self.prefix_hits.inc(last.prefix_hit_tokens)
            self.preemptions.inc(last.num_preempted)
            self.prompt_tokens.inc(last.num_prefill_tokens)
        self.steps.inc()
        self.step_seconds.inc(seconds)
        self.loop_seconds.inc(loop_seconds)

    def on_finished(self, out: RequestOutput) -> None:
        """When a request finishes, on the event loop."""
        reasons = {c.finish_reason or "abort" for c in out.outputs} or {"abort"}
        for reason in reasons:
            self.success.labels(self.model_name, reason).inc()
        for rec in out.records:
            self.generation_tokens.inc(rec.num_output_tokens)
            if rec.first_token is not None:
                self.ttft.observe(rec.first_token - rec.arrival)
            if rec.first_scheduled is not None:
                self.queue.observe(rec.first_scheduled - rec.arrival)
            times = rec.token_times
            for a, b in zip(times, times[1:]):
                self.itl.observe(b - a)
            if len(times) > 1:
                self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))
            if rec.finished is not None:
                self.e2e.observe(rec.finished - rec.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
