"""The transformers-facing surface above the engine: patch, generate, streaming, pipelines and
beam search (which drives the engine from above)."""
