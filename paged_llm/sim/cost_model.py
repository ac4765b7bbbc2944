"""A roofline step-time model of one engine iteration on a GPU (plain Python, no torch).

A step streams every weight once and reads the KV cache of every context token of every
scheduled request; it also does 2 FLOPs per parameter per new token plus attention. Its
duration is the slower of the two at achievable (not peak) rates, plus a fixed per-iteration
overhead (scheduling, kernel launches, sampling), plus tensor-parallel all-reduces and swaps.
Leaving out the KV read makes a simulated A100 several times too fast at large batches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from paged_llm.sim.hardware import GPUSpec
from paged_llm.sim.model_shapes import ModelShape

# The paper's Fig. 18a: its paged attention kernel is 20-26% slower than FasterTransformer's
# contiguous one at block size 16. We model the gap as a fixed cost per block read (block-table
# lookup, a dependent load, a partly used last tile), worth this many token reads:
# 16 * 0.23 = 3.7, so block size b costs (1 + 3.7 / b) times a contiguous read.
PAGED_BLOCK_OVERHEAD_TOKENS = 16 * 0.23


@dataclass(frozen=True)
class StepShape:
    """What one iteration computes, summed over its scheduled requests."""

    num_seqs: int
    num_new_tokens: int
    kv_tokens_read: int  # context tokens (cached + new) whose K/V attention reads
    kv_blocks_read: int  # blocks those tokens occupy
    attn_pairs: int  # causal (query, key) pairs: new * cached + new * (new + 1) / 2 per request
    swap_blocks: int = 0  # blocks copied between host and device this step

    @classmethod
    def decode(cls, batch: int, context: int, block_size: int = 16) -> StepShape:
        """A pure decode step: ``batch`` requests, each with ``context`` tokens after the step."""
        blocks = -(-context // block_size)
        return cls(batch, batch, batch * context, batch * blocks, batch * context)


@dataclass(frozen=True)
class RooflineCostModel:
    """Step time = overhead + max(bytes / bandwidth, FLOPs / peak) + all-reduce + swap."""

    hardware: GPUSpec
    model: ModelShape
    num_gpus: int = 1  # tensor parallelism: weights, KV, bandwidth and FLOPs split evenly
    block_size: int = 16
    # Achievable fractions of the data-sheet peaks. The defaults are typical for fp16 decode
    # (streaming GEMV-like reads) and mid-size prefill GEMMs; calibrate from measured step
    # times (paged_llm.sim.calibration) for numbers that matter.
    mem_efficiency: float = 0.8
    compute_efficiency: float = 0.6
    overhead_s: float = 1e-3
    block_overhead_tokens: float = PAGED_BLOCK_OVERHEAD_TOKENS
    # CPU work per scheduled request per iteration that the GPU waits for (input preparation,
    # per-request sampling, detokenization). 0 by default: the paper's Fig. 1 step times leave
    # no room for it once the KV read is counted (see docs/paper_repro.md).
    per_seq_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("mem_efficiency", "compute_efficiency"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        if self.num_gpus < 1 or min(self.overhead_s, self.block_overhead_tokens) < 0:
            raise ValueError("num_gpus >= 1, overhead_s >= 0 and block_overhead_tokens >= 0")
        if self.per_seq_overhead_s < 0:
            raise ValueError(f"per_seq_overhead_s must be >= 0, got {self.per_seq_overhead_s}")

    # ---- the parts of a step ------------------------------------------------------------------
    @property
    def bandwidth(self) -> float:
        """Achievable memory bandwidth of all GPUs together, bytes/s."""
        return self.hardware.mem_bandwidth * self.mem_efficiency * self.num_gpus

    @property
    def flops(self) -> float:
        """Achievable FLOP/s of all GPUs together."""
        return self.hardware.peak_flops * self.compute_efficiency * self.num_gpus

    def memory_bytes(self, step: StepShape) -> float:
        """Weights (a mixture of experts: those its tokens route to), KV read (with the
        per-block overhead) and KV written."""
        kv = self.model.kv_bytes_per_token
        reads = step.kv_tokens_read + step.kv_blocks_read * self.block_overhead_tokens
        weights = self.model.weight_bytes_read(step.num_new_tokens)
        return weights + kv * (reads + step.num_new_tokens)

    def compute_flops(self, step: StepShape) -> float:
        """Matmul FLOPs of the new tokens plus attention FLOPs of every causal pair."""
        m = self.model
        return m.linear_flops_per_token * step.num_new_tokens + m.attn_flops_per_token_pair * (
            step.attn_pairs
        )

    def allreduce_time(self, step: StepShape) -> float:
        """Two ring all-reduces of the activations per layer under tensor parallelism."""
        g = self.num_gpus
        if g == 1:
            return 0.0
        msg = step.num_new_tokens * self.model.hidden_size * self.model.dtype_bytes
        per = (
            self.hardware.allreduce_latency_s + 2 * (g - 1) / g * msg / self.hardware.peer_bandwidth
        )
        return 2 * self.model.num_layers * per

    def swap_time(self, num_blocks: int) -> float:
        """Copy ``num_blocks`` blocks over the host link: one copy per block, layer, K and V."""
        if num_blocks == 0:
            return 0.0
        copies = num_blocks * self.model.num_layers * 2
        block_bytes = self.block_size * self.model.kv_bytes_per_token / self.num_gpus
        return copies * self.hardware.host_copy_latency_s + num_blocks * block_bytes / (
            self.hardware.host_link_bandwidth
        )

    def breakdown(self, step: StepShape) -> dict[str, float]:
        """Every term of the step time, in seconds."""
        return {
            "memory_s": self.memory_bytes(step) / self.bandwidth,
            "compute_s": self.compute_flops(step) / self.flops,
            "allreduce_s": self.allreduce_time(step),
            "swap_s": self.swap_time(step.swap_blocks),
            "overhead_s": self.overhead_s + self.per_seq_overhead_s * step.num_seqs,
        }

    def step_time(self, step: StepShape) -> float:
        """Seconds one iteration takes."""
        if step.num_new_tokens == 0:
            return self.swap_time(step.swap_blocks) + (self.overhead_s if step.swap_blocks else 0)
        roofline = max(
            self.memory_bytes(step) / self.bandwidth, self.compute_flops(step) / self.flops
        )
        fixed = self.overhead_s + self.per_seq_overhead_s * step.num_seqs
        return fixed + roofline + self.allreduce_time(step) + self.swap_time(step.swap_blocks)

    def least_busy_time(self, total: StepShape, steps: int) -> float:
        """A lower bound on the summed ``step_time`` of any ``steps`` steps (each with new
        tokens) whose shapes add up to ``total``: the fixed costs ``steps`` times, every step's
        weight read at its fewest (one token's), and a sum of per-step maxima is at least the
        maximum of the sums (experiments/capacity/bound.py)."""
        weights = self.model.weight_bytes_read(total.num_new_tokens)
        memory = self.memory_bytes(total) - weights + steps * self.model.weight_bytes_read(1)
        roofline = max(memory / self.bandwidth, self.compute_flops(total) / self.flops)
        fixed = steps * self.overhead_s + self.per_seq_overhead_s * total.num_seqs
        return fixed + roofline + self._allreduce_over(total, steps)

    def _allreduce_over(self, total: StepShape, steps: int) -> float:
        """The all-reduces of ``steps`` steps of ``total`` tokens: the bytes once, the latency
        per step (linear in the message, so the split does not matter)."""
        no_tokens = StepShape(0, 0, 0, 0, 0)
        return self.allreduce_time(total) + (steps - 1) * self.allreduce_time(no_tokens)

    def prefill_time(self, num_tokens: int) -> float:
        """Seconds to (re)compute a prompt of ``num_tokens`` alone (recompute preemption cost)."""
        n = num_tokens
        blocks = -(-n // self.block_size)
        return self.step_time(StepShape(1, n, n, blocks, n * (n + 1) // 2))

    # ---- memory planning ----------------------------------------------------------------------
    def num_kv_blocks(
        self, gpu_memory_utilization: float = 0.9, activation_bytes: float = 0.0
    ) -> int:
        """KV blocks that fit beside the weights and the activations on all GPUs."""
        budget = self.hardware.memory_bytes * self.num_gpus * gpu_memory_utilization
        budget -= self.model.weight_bytes + activation_bytes
        block_bytes = self.block_size * self.model.kv_bytes_per_token
        if budget < block_bytes:
            raise ValueError(
                f"{self.model.name} ({self.model.weight_bytes / 1e9:.0f} GB of weights) leaves no "
                f"room for a KV cache on {self.num_gpus} x {self.hardware.name}"
            )
        return int(budget // block_bytes)

    def activation_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> float:
        """Peak activation memory of a full step: one layer's widest tensors plus the logits."""
        m = self.model
        per_token = (4 * m.hidden_size + 4 * m.hidden_size) * m.dtype_bytes  # FFN in + residuals
        logits = min(max_num_seqs, max_num_batched_tokens) * m.vocab_size * 4  # fp32 logits
        return max_num_batched_tokens * per_token + logits

    def with_params(self, **params: Any) -> RooflineCostModel:
        """A copy with some parameters changed (used by calibration)."""
        return replace(self, **params)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for result files."""
        d = asdict(self)
        d["hardware"], d["model"] = self.hardware.to_dict(), self.model.to_dict()
        d["effective_bandwidth"], d["effective_flops"] = self.bandwidth, self.flops
        return d
