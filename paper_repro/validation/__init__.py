"""Pieces of ``paper_repro.validate_sim``: the model it runs, the comparison it reports."""
