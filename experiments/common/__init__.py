"""What the experiments share: workloads (``workloads``), the transformers baselines
(``hf_baselines``), hardware records (``hardware``), random Llama checkpoints
(``checkpoints``) and timing (``timing``)."""
