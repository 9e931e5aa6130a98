"""An OpenAI-compatible HTTP server over one Engine (`hf-paged serve MODEL`).

protocol.py: request bodies and their SamplingParams; detokenizer.py: incremental text with stop
strings; async_engine.py: the engine loop thread and the asyncio front; engine_client.py,
engine_core_proc.py, core_messages.py: the same front with the engine in a process of its own
(--engine-process: API side, engine side, their messages); fronts.py: what both fronts share;
serving.py: OpenAI responses and stream chunks; metrics.py: Prometheus; api_server.py: routes,
limits, errors; serve.py: the command line. Needs the `serve` extra (fastapi, uvicorn,
prometheus_client).
"""
