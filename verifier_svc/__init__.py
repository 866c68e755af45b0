"""Verifier service: the target model, its KV cache and running batch, SpecEngine over a remote drafter."""
