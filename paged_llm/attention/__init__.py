"""Swappable attention backends over the paged KV cache."""

from paged_llm.attention.base import AttentionBackend
from paged_llm.attention.metadata import AttentionMetadata, build_attention_metadata

__all__ = ["AttentionBackend", "AttentionMetadata", "build_attention_metadata"]
