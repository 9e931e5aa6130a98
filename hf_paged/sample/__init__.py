"""Turning logits into tokens: the sampler and logits processing (transformers' processors)."""
