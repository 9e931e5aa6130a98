"""hf_paged: paged-attention continuous batching behind transformers model.generate."""
