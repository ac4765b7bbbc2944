"""Attention over a paged KV cache (prefill with prefix, chunked prefill and decode)."""
