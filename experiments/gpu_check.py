"""The GPU check's earlier name: ``python -m experiments.gpu_check`` runs ``python -m
experiments.gpu`` (experiments/gpu/), which the docs and older result files name."""

import experiments.gpu  # noqa: F401  (sets TRITON_INTERPRET for --smoke before torch loads)
from experiments.gpu.cli import main

if __name__ == "__main__":
    main()
