"""Experiment loggers and run metadata."""
