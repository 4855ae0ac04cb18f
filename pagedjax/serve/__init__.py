"""Online serving: an OpenAI-compatible HTTP server (api_server) over one engine loop (async_llm),
with Prometheus metrics (metrics) and the OpenAI request and response bodies (protocol).
`pagedjax serve MODEL` (pagedjax.cli) starts it."""
