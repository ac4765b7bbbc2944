"""Multi-LoRA serving: PEFT adapters applied per request on a shared base model (vLLM's
``enable_lora``). See docs/lora.md."""

from paged_llm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
