"""Tensor ops, one folder each: a plain torch ``reference.py`` beside a Triton ``triton.py``."""
