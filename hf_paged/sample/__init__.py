"""Turning logits into tokens: the stateless sampler over SamplingRows (metadata) and logits
processing (transformers' processors, per-row parameters)."""
