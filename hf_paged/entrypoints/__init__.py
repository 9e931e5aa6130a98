"""An OpenAI-compatible HTTP server over one Engine (`hf-paged serve MODEL`).

protocol.py: request bodies and their SamplingParams; detokenizer.py: incremental text with stop
strings; async_engine.py: the engine loop thread and the asyncio front; serving.py: OpenAI
responses and stream chunks; metrics.py: Prometheus; api_server.py: routes, limits, errors;
serve.py: the command line. Needs the `serve` extra (fastapi, uvicorn, prometheus_client).
"""
