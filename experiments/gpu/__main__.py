"""``python -m experiments.gpu [--quick | --smoke] --out DIR``: the GPU check (see the package)."""

from experiments.gpu.cli import main

if __name__ == "__main__":
    main()
