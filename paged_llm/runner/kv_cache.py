"""Allocation of the per-layer KV pools and block moves between them; the runner's pools."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from paged_llm.quant.kv_cache import SCALE_DTYPE, KVCacheSpec

if TYPE_CHECKING:
    from paged_llm.runner.collaborators import KVConnectorWorker
    from paged_llm.spec.base import Drafter

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k, v) [blocks, bs, Hkv, D]


def kv_bytes_per_block(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    scale_dtype: torch.dtype | None = None,  # quantized cache: one scale per (token, head)
) -> int:
    """Bytes one block occupies across all layers, K and V (and their scales, if any)."""
    elem = torch.empty((), dtype=dtype).element_size()
    scale = torch.empty((), dtype=scale_dtype).element_size() if scale_dtype else 0
    return 2 * num_layers * block_size * num_kv_heads * (head_dim * elem + scale)


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    pin_memory: bool = False,
) -> KVCaches:
    """One zeroed [num_blocks, block_size, Hkv, D] pool for K and one for V, per layer."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory),
            torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory),
        )
        for _ in range(num_layers)
    ]


def allocate_kv_scales(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    device: torch.device | str,
    pin_memory: bool = False,
) -> KVCaches:
    """Per layer (k_scale, v_scale) [num_blocks, block_size, Hkv] for a quantized cache: the
    same slots as the cache, so block moves treat them exactly like the caches."""
    pools = allocate_kv_caches(
        num_layers, num_blocks, block_size, num_kv_heads, 1, dtype, device, pin_memory
    )
    return [(k[..., 0], v[..., 0]) for k, v in pools]


def move_blocks(
    src: list[tuple[torch.Tensor, ...]], dst: list[tuple[torch.Tensor, ...]],
    mapping: list[tuple[int, int]],
) -> None:  # fmt: skip
    """Copy block src_id of every pool in ``src`` (per layer (k, v), or any tuple of tensors
    indexed by block first) to block dst_id of the matching pool in ``dst``."""
    if not mapping:
        return
    src_ids = torch.tensor([s for s, _ in mapping], dtype=torch.long)
    dst_ids = torch.tensor([d for _, d in mapping], dtype=torch.long)
    # (an offload tier's list is shorter: it carries no companions' pools)
    for src_group, dst_group in zip(src, dst):
        for src_t, dst_t in zip(src_group, dst_group, strict=True):
            rows = src_t.index_select(0, src_ids.to(src_t.device)).to(dst_t.device)
            # Indexed assignment rather than index_copy_, which has no float8 (fp8 cache) kernel.
            dst_t[dst_ids.to(dst_t.device)] = rows


class RunnerKVPools:
    """The model runner's KV pools (device, CPU swap, the prefix cache's CPU tier, and the
    scales of a quantized cache) and the block moves a step's ``block_ops`` ask for.
    ``ModelRunner`` inherits them; a step enters this class only when it moves blocks."""

    def _init_pools(
        self, kv_spec: KVCacheSpec, drafter: Drafter | None, kv_connector: KVConnectorWorker | None
    ) -> None:
        self.kv_spec = kv_spec
        self.kv_caches: KVCaches = []
        self.cpu_caches: KVCaches = []
        self.kv_scales: KVCaches = []  # quantized cache only: per layer [blocks, bs, Hkv] scales
        self.cpu_scales: KVCaches = []
        # the prefix cache's CPU tier (kv_offloading_size): its own pool beside the swap pool
        self.offload_caches: KVCaches = []
        self.offload_scales: KVCaches = []
        self.kv_connector = kv_connector
        # Pools of other owners that share the block ids (an EAGLE head's): ``block_pools(where)``
        self.block_companions: list[Drafter] = (
            [drafter] if drafter and drafter.moves_with_blocks else []
        )
        # Scale pools and companions' pools share the caches' slots, so every block op moves
        # them alongside (the offload tier and KV connectors carry the caches and scales only).
        device = lambda: self.kv_caches + self.kv_scales + self._companion_pools("device")
        cpu = lambda: self.cpu_caches + self.cpu_scales + self._companion_pools("cpu")
        offload = lambda: self.offload_caches + self.offload_scales
        self._block_op_caches = {"copy": (device, device), "swap_out": (device, cpu),
                                 "swap_in": (cpu, device), "offload": (device, offload),
                                 "onload": (offload, device)}  # fmt: skip

    def _companion_pools(self, where: str) -> list[tuple[torch.Tensor, ...]]:
        return [pool for c in self.block_companions for pool in c.block_pools(where)]

    def block_bytes(self) -> int:
        """Bytes of one block of this rank's KV pools (all layers, K and V, scales)."""
        scale = SCALE_DTYPE if self.kv_spec.quantized else None
        return kv_bytes_per_block(self.num_layers, self.num_kv_heads, self.head_dim,
                                  self.block_size, self.kv_spec.dtype, scale)  # fmt: skip

    def initialize_cache(
        self, num_blocks: int, num_cpu_blocks: int, num_offload_blocks: int = 0
    ) -> None:
        """Allocate the device pool, the CPU swap pool and the prefix cache's CPU tier."""
        self.kv_caches, self.kv_scales = self._pools(num_blocks, self.device)
        self.cpu_caches, self.cpu_scales = self._pools(num_cpu_blocks, "cpu")
        self.offload_caches, self.offload_scales = self._pools(num_offload_blocks, "cpu")

    def _pools(self, num_blocks: int, device: torch.device | str) -> tuple[KVCaches, KVCaches]:
        """K/V pools of ``num_blocks`` (and their scales for a quantized cache); host pools are
        pinned when the device is a GPU, for fast copies. Nothing for 0 blocks."""
        if not num_blocks:
            return [], []
        pin = str(device) == "cpu" and self.device.type == "cuda"
        shape_args = (self.block_size, self.num_kv_heads, self.head_dim, self.kv_spec.dtype)
        caches = allocate_kv_caches(self.num_layers, num_blocks, *shape_args, device, pin)
        if not self.kv_spec.quantized:
            return caches, []
        scale_args = (self.block_size, self.num_kv_heads, SCALE_DTYPE)
        return caches, allocate_kv_scales(self.num_layers, num_blocks, *scale_args, device, pin)

    def apply_block_ops(
        self, block_ops: list[tuple[str, list[tuple[int, int]]]]
    ) -> list[tuple[int, int]]:
        """Copy, swap, offload and load blocks in decision order (a block may be reused within
        a step); return the KV connector's saves, which wait until the forward has run."""
        saves = []
        for kind, pairs in block_ops:
            if kind == "kv_save":  # logged last; the forward writes these blocks
                saves.extend(pairs)
            elif kind == "kv_load":
                self.kv_connector.load(self._transfer_pools(), pairs)
            else:
                src, dst = self._block_op_caches[kind]
                move_blocks(src(), dst(), pairs)
        return saves

    def save_blocks(self, saves: list[tuple[int, int]]) -> None:
        """Hand the blocks the forward wrote to the KV connector (``apply_block_ops``' saves)."""
        self.kv_connector.save(self._transfer_pools(), saves)

    def _transfer_pools(self) -> dict[str, KVCaches]:
        """What a KV connector moves per block: the caches and, if quantized, their scales."""
        return {"kv": self.kv_caches, "scales": self.kv_scales}
