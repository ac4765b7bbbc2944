"""Capacity planning by simulation: for each candidate deployment, the highest request rate
that meets every latency SLO (``rate_search``), its price (``deployment``), and the ranking
by requests per dollar with its Pareto front (``report``). ``python -m
experiments.capacity_plan`` is the Hydra entry point; docs/capacity_planning.md explains it."""
