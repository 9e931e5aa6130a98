"""Glue between hf_paged and transformers / peft / bitsandbytes (as hf_paged.integrations)."""
