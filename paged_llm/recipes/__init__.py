"""Training recipes for the built-in models (see :mod:`paged_llm.models.trained`): the stdlib
corpus and its tokenizer, the training loop, and the on-disk cache they are built into."""
