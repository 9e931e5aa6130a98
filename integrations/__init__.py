"""Glue between hf_paged and transformers / peft / bitsandbytes (installed as hf_paged.integrations)."""
