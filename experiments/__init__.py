"""Benchmarks and experiment entry points."""
