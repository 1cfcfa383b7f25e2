"""Llama-architecture models (target and standalone draft) and the EAGLE-3 head."""
