"""Scripts that reproduce the vLLM paper figures."""
