"""``python -m paged_llm.serve``: same as the ``paged-llm-serve`` console script."""

from paged_llm.serve.cli import main

main()
