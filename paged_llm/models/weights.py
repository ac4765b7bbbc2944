"""Weight loading for the causal LMs (``CausalLM`` inherits ``CheckpointWeights``): checkpoint
tensors renamed to parameters, sliced for tensor parallelism, checked and copied in, whole at
load time or any part later (``update_weights``, e.g. after a training step)."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable

import torch
from torch import nn

from paged_llm.distributed.sharding import shard_checkpoint
from paged_llm.lora.layers import LoRALinear

logger = logging.getLogger("paged_llm.models.base")  # where users look for its lines


class CheckpointWeights:
    """The loading half of ``CausalLM`` (an ``nn.Module`` with ``tie_word_embeddings`` and
    ``tie_weights``); a model overrides ``checkpoint_name`` and friends for its own names."""

    def checkpoint_name(self, name: str) -> str | None:
        """Map a checkpoint tensor name onto a parameter name; None means "ignore this tensor"."""
        return name

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str | None, torch.Tensor]]:
        """The checkpoint's tensors under parameter names (see :meth:`checkpoint_name`)."""
        return ((self.checkpoint_name(n), t) for n, t in weights)

    def lora_tensors(
        self, module: str, a: torch.Tensor, b: torch.Tensor
    ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """Where a LoRA adapter's A and B for checkpoint ``module`` go: that module itself; a
        model whose checkpoint fuses layers (GPT-2's ``c_attn``) splits them."""
        return [(module, a, b)]

    def export_name(self, name: str) -> str:
        """The checkpoint name of parameter ``name`` (for writing HF-layout checkpoints)."""
        return name

    def fused_linears(self) -> dict[str, list[tuple[str, torch.Tensor]]]:
        """Linear layers the checkpoint fuses and this model keeps apart: the checkpoint
        layer's name -> [(our layer, the fused layer's output rows it holds)]. The float
        weights are split by :meth:`checkpoint_tensors`; pre-quantized checkpoints, whose
        packed tensors cannot be split row-wise, read this map instead."""
        return {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters; raise on unexpected or missing ones."""
        loaded = load_named_weights(
            self, self._parameter_tensors(weights), optional={"lm_head.weight"}
        )
        if "lm_head.weight" not in loaded and not self.tie_word_embeddings:
            logger.warning("checkpoint has no lm_head.weight: tying the LM head to the embeddings")
            self.tie_word_embeddings = True
            self.tie_weights()

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy HF-named tensors, any part of a checkpoint, into the parameters in place (e.g.
        after a training step); all are checked first, so a bad name or shape changes nothing.
        Returns the parameter names written."""
        items = [(n, t) for n, t in self._parameter_tensors(weights) if n is not None]
        params = dict(self.named_parameters())
        unexpected = [n for n, _ in items if n not in params]
        if unexpected:
            raise ValueError(f"unexpected tensors: {_summary(unexpected)}")
        for name, tensor in items:
            _check_shape(name, params[name], tensor)
        with torch.no_grad():
            for name, tensor in items:
                params[name].copy_(tensor)
        return [n for n, _ in items]

    def _parameter_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str | None, torch.Tensor]]:
        """Checkpoint tensors under this rank's parameter names: renamed, under a wrapper's
        ``base`` where one wraps the layer, sliced for tensor parallelism, and without a copy
        of a tied head (which has no storage of its own; some checkpoints still carry one)."""
        wrapped = self._wrapped_names()
        renamed = ((wrapped.get(n, n), t) for n, t in self.checkpoint_tensors(weights))
        renamed = shard_checkpoint(self, renamed)
        if self.tie_word_embeddings:
            renamed = ((n, t) for n, t in renamed if n != "lm_head.weight")
        return renamed

    def _wrapped_names(self) -> dict[str, str]:
        """Checkpoint names of parameters that a wrapper layer holds as its ``base`` (LoRA's
        ``LoRALinear``) -> their names inside the wrapper."""
        out = {}
        for prefix, module in self.named_modules():
            if isinstance(module, LoRALinear):
                for name, _ in module.base.named_parameters():
                    out[f"{prefix}.{name}"] = f"{prefix}.base.{name}"
        return out


def _check_shape(name: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
    if param.shape != tensor.shape:
        raise ValueError(
            f"shape mismatch for '{name}': checkpoint {tuple(tensor.shape)}, "
            f"model {tuple(param.shape)}"
        )


def load_named_weights(
    module: nn.Module,
    weights: Iterable[tuple[str | None, torch.Tensor]],
    optional: Collection[str] = (),
) -> set[str]:
    """Copy each (name, tensor) into ``module``'s parameter of that name (None names are
    skipped); return the names loaded. Raises ValueError listing unexpected names, shape
    mismatches, and parameters never loaded (except those in ``optional``)."""
    params = dict(module.named_parameters())  # shared (tied) parameters appear once
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if name is None:
            continue
        param = params.get(name)
        if param is None:
            unexpected.append(name)
            continue
        _check_shape(name, param, tensor)
        with torch.no_grad():
            param.copy_(tensor)  # casts to the model's dtype and device
        loaded.add(name)
    if unexpected:
        raise ValueError(f"unexpected tensors in checkpoint: {_summary(unexpected)}")
    missing = sorted(set(params) - loaded - set(optional))
    if missing:
        raise ValueError(f"tensors missing from checkpoint: {_summary(missing)}")
    return loaded


def _summary(names: list[str], limit: int = 8) -> str:
    """A bounded, readable list of names for error messages."""
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
