"""One candidate deployment of the capacity search: the hardware, how many GPUs, the engine's
batching and KV settings, and the weight and KV-cache precision; what it costs per hour and
the simulated executor that prices its steps (plain Python, no torch)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from paged_llm.core.kv import POLICIES
from paged_llm.sim.executor import SimulatedExecutor
from paged_llm.sim.model_shapes import ModelShape, get_model_shape
from paged_llm.sim.settings import ServingSettings

# Bytes per stored element of each precision the roofline can price (it prices bytes moved
# and held; dequantization arithmetic and accuracy are not modelled: experiments/quant_eval.py
# measures those on real models).
WEIGHT_BYTES = {"fp16": 2.0, "int8": 1.0, "fp8": 1.0, "int4": 0.5}
KV_BYTES = {"auto": 2.0, "int8": 1.0, "fp8_e4m3": 1.0}


@dataclass(frozen=True)
class QuantizedShape(ModelShape):
    """A model shape whose weights and KV cache are stored at their own precisions (bytes per
    element); activations and all-reduces stay at ``dtype_bytes``."""

    weight_bytes_per_param: float = 2.0
    kv_bytes_per_element: float = 2.0

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer at the KV cache's precision."""
        return round(2 * self.num_layers * self.num_kv_heads * self.head_dim
                     * self.kv_bytes_per_element)  # fmt: skip

    @property
    def weight_bytes(self) -> int:
        """Bytes of the parameters at the weights' precision."""
        return round(self.num_params * self.weight_bytes_per_param)

    def weight_bytes_read(self, num_tokens: int) -> float:
        """The dense shape's weight read, rescaled to the weights' precision."""
        return (
            super().weight_bytes_read(num_tokens) / self.dtype_bytes * (self.weight_bytes_per_param)
        )


def quantized(shape: ModelShape, weights: str, kv_cache_dtype: str) -> ModelShape:
    """``shape`` with its weights and KV cache stored at the named precisions (keys of
    WEIGHT_BYTES and KV_BYTES)."""
    fields = {k: v for k, v in asdict(shape).items() if not k.endswith("_per_param")}
    fields.pop("kv_bytes_per_element", None)
    return QuantizedShape(**fields, weight_bytes_per_param=WEIGHT_BYTES[weights],
                          kv_bytes_per_element=KV_BYTES[kv_cache_dtype])  # fmt: skip


@dataclass(frozen=True)
class Deployment:
    """What the search varies (the ``deployment`` config node)."""

    # a preset of paged_llm/sim/hardware.py (or the device a given executor prices: "cpu")
    hardware: str = "a100-40gb"
    num_gpus: int = 1  # tensor-parallel degree
    policy: str = "paged"  # a KV policy of paged_llm.core.kv.POLICIES
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2560
    enable_chunked_prefill: bool = False
    weights: str = "fp16"  # a key of WEIGHT_BYTES
    kv_cache_dtype: str = "auto"  # a key of KV_BYTES

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy '{self.policy}'; choose one of {list(POLICIES)}")
        if self.num_gpus < 1 or self.block_size < 1:
            raise ValueError("num_gpus and block_size must be >= 1")
        if self.weights not in WEIGHT_BYTES or self.kv_cache_dtype not in KV_BYTES:
            raise ValueError(
                f"weights must be one of {list(WEIGHT_BYTES)} and kv_cache_dtype one of "
                f"{list(KV_BYTES)}; got {self.weights!r}, {self.kv_cache_dtype!r}"
            )

    def settings(self, engine: Mapping[str, Any]) -> ServingSettings:
        """The engine settings: the shared ``engine`` node with this deployment's own values;
        the KV pool is the node's ``num_gpu_blocks`` (absent or null: what fits the GPUs'
        memory). Without chunked prefill a step must hold a
        whole prompt, so the token budget must cover ``max_model_len`` (vLLM's rule)."""
        s = ServingSettings(**engine).with_overrides(
            block_size=self.block_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
        )  # fmt: skip
        if not s.enable_chunked_prefill and s.max_num_batched_tokens < s.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={s.max_num_batched_tokens} < max_model_len="
                f"{s.max_model_len} needs enable_chunked_prefill=true"
            )
        return s

    def executor(
        self, model_shape: Mapping[str, Any], cost: Mapping[str, Any]
    ) -> SimulatedExecutor:
        """The simulated executor of this deployment: the model at its precisions on
        ``num_gpus`` of the hardware, priced by the roofline with ``cost``'s efficiencies."""
        spec = dict(model_shape)
        shape = quantized(get_model_shape(spec.pop("name"), **spec), self.weights,
                          self.kv_cache_dtype)  # fmt: skip
        return SimulatedExecutor(self.hardware, shape, self.num_gpus, dict(cost))

    def price_per_hour(self, prices: Mapping[str, float]) -> float:
        """Dollars per hour: the hardware's price per GPU-hour times the GPUs."""
        key = self.hardware.lower()
        if key not in prices:
            raise ValueError(f"no price per GPU-hour for '{self.hardware}' in {dict(prices)}")
        return float(prices[key]) * self.num_gpus

    def label(self) -> str:
        """A short name for tables and plots."""
        chunk = "+chunk" if self.enable_chunked_prefill else ""
        quant = (
            ""
            if (self.weights, self.kv_cache_dtype) == ("fp16", "auto")
            else (f" w:{self.weights} kv:{self.kv_cache_dtype}")
        )
        return (f"{self.num_gpus}x{self.hardware} {self.policy} b{self.block_size} "
                f"s{self.max_num_seqs} t{self.max_num_batched_tokens}{chunk}{quant}")  # fmt: skip

    def with_overrides(self, **kw: Any) -> Deployment:
        """A copy with some fields changed."""
        return replace(self, **kw)
