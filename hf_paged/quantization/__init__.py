"""Quantization: FP8 KV cache (kv_cache.py), FP8 weights (fp8_linear.py) and the checks for
bitsandbytes models as transformers loaded them (bitsandbytes.py). docs/quantization.md"""
