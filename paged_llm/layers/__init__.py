"""Model building blocks shared by the architectures in ``paged_llm.models``."""
