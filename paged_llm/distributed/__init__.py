"""Tensor parallelism (``LLM(..., tensor_parallel_size=N)``), Megatron-style, over
torch.distributed: gloo on CPUs, NCCL on GPUs. See docs/tensor_parallel.md.

* ``parallel_state``: the group a model is built for; the all-reduce and gather its layers use
* ``layers``: column / row parallel linears, vocab-parallel embedding and LM head, and the
  factories model files call (plain nn.Linear / nn.Embedding at world size 1)
* ``sharding``: who owns which rows, columns, vocabulary entries and heads; checkpoint slicing
* ``checks``: every unsupported combination, as one ValueError before anything starts
* ``launch``: spawning / joining the world, rank 0's per-step broadcast, tear-down
* ``worker``: the spawned ranks' entry point
"""

from paged_llm.distributed.parallel_state import TPGroup, building_for, current_group

__all__ = ["TPGroup", "building_for", "current_group"]
