"""Multi-LoRA: a PeftModel's LoRA adapters applied per request inside one batch."""
