"""vLLM's ``LoRARequest``: which adapter a request runs with (``from paged_llm.lora.request
import LoRARequest``, the same import path as vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass

from paged_llm.utils.checks import is_int


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter by name, a positive integer id unique per adapter, and its directory (a
    PEFT checkpoint: ``adapter_config.json`` plus ``adapter_model.safetensors`` or ``.bin``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None  # vLLM's; only reported by the server's /v1/models

    def __post_init__(self) -> None:
        if not is_int(self.lora_int_id) or self.lora_int_id < 1:
            # 0 means "no adapter" in the batch bookkeeping, as in vLLM
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter '{self.lora_name}' has no lora_path")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of ``lora_int_id``."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """vLLM's alias of ``lora_name``."""
        return self.lora_name

    @property
    def path(self) -> str:
        """vLLM's alias of ``lora_path``."""
        return self.lora_path
