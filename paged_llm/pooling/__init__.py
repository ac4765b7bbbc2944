"""Pooling models (vLLM's ``runner="pooling"``): a prompt's hidden states -> one embedding (or
one vector per token), instead of generated tokens. ``config.py`` says how a model pools,
``methods.py`` holds the pooling types, ``pooler.py`` reduces each request's prompt chunks."""
