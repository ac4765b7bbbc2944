"""The paper's published numbers that the figure scripts compare against
(docs/paper_numbers.md; Kwon et al., SOSP 2023). (fig) marks values read off a figure."""

from __future__ import annotations

# Fig. 11: mean request lengths (tokens, OPT tokenizer) of the two workloads, after the filter
# input + output < 2048.
FIG11_MEAN_LENGTHS = {
    "sharegpt": {"input_len": 161.31, "output_len": 337.99},
    "alpaca": {"input_len": 19.31, "output_len": 58.45},
}

# Fig. 2: shares of the KV pool (fractions), OPT-13B / A100-40GB / ShareGPT.
_SHARE_KEYS = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation")
FIG2 = {
    "orca_max": dict(zip(_SHARE_KEYS, (0.204, 0.133, 0.573, 0.089))),
    "orca_pow2": dict(zip(_SHARE_KEYS, (0.268, 0.179, 0.136, 0.416))),
    "orca_oracle": dict(zip(_SHARE_KEYS, (0.382, 0.252, 0.0, 0.366))),
    # vLLM (fig): the artifact recorded no reservation/internal split for vLLM.
    "paged": dict(zip(_SHARE_KEYS, (0.963, 0.01, 0.01, 0.017))),
}
FIG2_TOLERANCE_PP = 6.0  # acceptance: each Orca token-state share within 6 percentage points
FIG2_PAGED_MIN = 0.95  # acceptance: the paged token-state share

# Fig. 12 (OPT-13B, ShareGPT): vLLM sustains 1.7-2.7x Orca (Oracle), 2.7-8x Orca (Max).
FIG12_RATIO_MIN = {"orca_oracle": 1.7, "orca_max": 2.7}
FIG12_RATIO_RANGE = {"orca_oracle": (1.7, 2.7), "orca_max": (2.7, 8.0)}
# The artifact's request-rate ranges (req/s), the x-axes of its plots.
FIG12_ARTIFACT_RATES = {
    "paged": (1.0, 2.0),
    "orca_oracle": (0.5, 1.5),
    "orca_pow2": (0.25, 0.9),
    "orca_max": (0.2, 0.75),
}

# Fig. 13: mean batched requests, OPT-13B.
FIG13 = {
    "sharegpt": {"orca_max": 7.00, "orca_pow2": 9.81, "orca_oracle": 13.62, "paged": 30.42},
    "alpaca": {"orca_max": 7.00, "orca_pow2": 43.24, "orca_oracle": 72.75, "paged": 132.44},
}
FIG13_TOLERANCE = 0.15  # acceptance: paged and Orca (Oracle) on ShareGPT within 15%

# Fig. 1 right (fig): vLLM throughput (tokens/s) by batch size; memory at the limit.
FIG1_THROUGHPUT = {8: 267.0, 16: 483.0, 24: 660.0, 32: 811.0, 40: 922.0}
FIG1_MEMORY_GB = {"existing_batch_at_39gb": 8, "vllm_batch_at_39gb": 38}

# Fig. 18b (fig): normalized latency (s/token) by block size.
_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
FIG18B = {
    "sharegpt": dict(zip(_BLOCK_SIZES, (2.30, 1.95, 1.98, 0.57, 0.085, 0.069, 0.086, 0.16, 1.36))),
    "alpaca": dict(zip(_BLOCK_SIZES, (3.62, 1.90, 2.12, 0.73, 0.59, 0.53, 1.90, 4.80, 18.2))),
}

# Fig. 19 (fig): preemption cost (ms) by block size 1..256 (OPT-13B, A100).
FIG19_SWAP_MS = {1: 137, 2: 89, 4: 61, 8: 47, 16: 40, 32: 37, 64: 35, 128: 34, 256: 33}
FIG19_RECOMPUTE_MS = (36, 39)  # flat across block sizes

# Fig. 14 (OPT-13B, Alpaca): vLLM's sustained rate over Orca (Oracle) grows from 1.3x with basic
# sampling to 2.3x with beam search of width 6 (Sec. 6.3).
FIG14_GAIN_OVER_ORACLE = {"basic": 1.3, "beam_6": 2.3}

# Fig. 15: memory saved by sharing = blocks saved / blocks without sharing (fractions).
FIG15 = {
    "alpaca": {
        "parallel_2": 0.0609, "parallel_4": 0.0853, "parallel_6": 0.0979,
        "beam_2": 0.3756, "beam_4": 0.5313, "beam_6": 0.5516,
    },
}  # fmt: skip
# ShareGPT: the text gives ranges only (over n / width 2-6).
FIG15_SHAREGPT_RANGE = {"parallel": (0.162, 0.305), "beam": (0.443, 0.663)}
FIG15_TOLERANCE_PP = 5.0  # acceptance: each Alpaca saving within 5 percentage points

# Fig. 16 (LLaMA-13B, WMT16 En->De): vLLM with the prefix shared over Orca (Oracle).
FIG16_PREFIX_LEN = {"one_shot": 80, "five_shot": 341}
FIG16_GAIN_OVER_ORACLE = {"one_shot": 1.67, "five_shot": 3.58}

# Fig. 17 (OPT-13B, ShareGPT chatbot, history cut to 1024 tokens): 2x every Orca variant.
FIG17_GAIN_OVER_ORCA = 2.0

# Fig. 18a (fig): the paged attention kernel's latency (us) per layer, by batch size and context
# length 64 / 128 / 256 (FasterTransformer's contiguous kernel: 21.9/34.9/62.3, 61.4/106.7/194.5).
FIG18A_PAGED_KERNEL_US = {
    8: {64: 31.5, 128: 43.6, 256: 84.3},
    32: {64: 77.1, 128: 127.1, 256: 235.3},
}
